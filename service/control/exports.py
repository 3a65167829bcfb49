"""Checkpoint downloads (`GET .../checkpoints/{id}/content?variant=`): which forms of the
model a checkpoint has, where their files are, and a tar archive of them, streamed.

The variants:
- `adapter` (LoRA jobs): the PEFT adapter that rank 0 writes beside every checkpoint's
  chunks (`<checkpoint dir>/adapter/`); small, so every checkpoint has it;
- `merged` (LoRA jobs): the model with the adapters merged in, a plain transformers
  directory: the job's export, written after its final checkpoint;
- `full` (full fine-tuning): the job's export, likewise of the final checkpoint only. The
  other checkpoints of a full fine-tuning job are the engine's chunks (sharded over the
  ranks, with the optimizer state), not a model a library loads.

A variant exists once its directory is complete (the engine writes each in a temporary
sibling and renames it into place), and only as long as Ray keeps the checkpoint.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from service.adapters import adapter_dir
from service.errors import NotAvailable
from service.settings import Settings
from service.spec.job import spec_of
from service.store import Checkpoint, Job

VARIANTS = ("adapter", "merged", "full")
# what a job's checkpoints download as: with adapters trained, or every weight
BY_ADAPTERS = {True: ("adapter", "merged"), False: ("full",)}
# the file a complete directory of each variant holds
MARKER = {"adapter": "adapter_config.json", "merged": "config.json", "full": "config.json"}
BLOCK = 512  # tar's block: headers and file data are padded to it
READ_BYTES = 1 << 20


def variants_of(job: Job) -> tuple[str, ...]:
    """What the job's checkpoints download as, the default first: the adapter (and the
    merged model) when its method trains adapters, else every weight."""
    return BY_ADAPTERS[spec_of(job).trains_adapters]


def default_variant(job: Job) -> str:
    return variants_of(job)[0]


def variant_dir(settings: Settings, job: Job, ck: Checkpoint, variant: str) -> Path | None:
    """The complete directory of `variant` for the checkpoint; None if there is none."""
    if variant not in variants_of(job):
        return None
    if variant == "adapter":
        d = adapter_dir(ck.path)
    elif ck.final:
        d = settings.finetuned_dir(job.id)
    else:
        return None
    return d if (d / MARKER[variant]).is_file() else None


def available(settings: Settings, job: Job, ck: Checkpoint) -> list[str]:
    """The variants the checkpoint downloads as now."""
    return [v for v in variants_of(job) if variant_dir(settings, job, ck, v)]


def content_dir(settings: Settings, job: Job, ck: Checkpoint, variant: str | None) -> Path:
    """The directory to send, or a 404 saying why there is none: the job's method never
    writes that variant, or this checkpoint does not have it (now)."""
    adapters = spec_of(job).trains_adapters
    allowed = BY_ADAPTERS[adapters]
    variant = variant or allowed[0]
    if variant not in allowed:
        kind = "LoRA" if adapters else "full fine-tuning"
        raise NotAvailable(
            f"variant '{variant}': a {kind} job's checkpoints download as "
            f"{' or '.join(repr(v) for v in allowed)}",
            param="variant",
            code="variant_not_available",
        )
    found = variant_dir(settings, job, ck, variant)
    if found is not None:
        return found
    have = available(settings, job, ck)
    if job.model_deleted_at is not None:
        why = "the job's fine-tuned model was deleted, and its checkpoints with it"
    elif job.run_reclaimed_at is not None:
        why = (
            "retention reclaimed the run's checkpoints after the job ended "
            "(PSTAR_RUN_RETENTION_DAYS); its exported model stays"
        )
    elif variant == "adapter":
        why = "its files are no longer on the service's storage (Ray keeps the newest checkpoints)"
    elif not ck.final:
        why = f"only the final checkpoint has it, and this one is at step {ck.step}"
    else:
        why = "the job has not exported its model (yet)"
    raise NotAvailable(
        f"checkpoint {ck.id} has no '{variant}' variant: {why}; it has "
        + (", ".join(repr(v) for v in have) if have else "none now"),
        param="variant",
        code="variant_not_available",
    )


@dataclass(frozen=True)
class Member:
    name: str
    path: Path
    size: int
    mtime: int

    def header(self) -> bytes:
        info = tarfile.TarInfo(self.name)
        info.size, info.mtime, info.mode = self.size, self.mtime, 0o644
        return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8")


def members(directory: Path) -> list[Member]:
    """The regular files directly in `directory` (a model directory is flat; the adapter
    beside a merged export is a variant of its own), by name."""
    out = []
    for p in sorted(directory.iterdir()):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            out.append(Member(p.name, p, st.st_size, int(st.st_mtime)))
    return out


def tar_size(files: list[Member]) -> int:
    return sum(len(m.header()) + _padded(m.size) for m in files) + 2 * BLOCK


def tar_stream(files: list[Member]) -> Iterator[bytes]:
    """A POSIX (pax) tar archive of `files`, produced a block of reads at a time (never
    the whole archive in memory); exactly `tar_size(files)` bytes. Every file is opened
    first, so a checkpoint that Ray deletes during the download still streams whole."""
    handles = [m.path.open("rb") for m in files]
    try:
        for m, f in zip(files, handles, strict=True):
            yield m.header()
            left = m.size
            while left:
                data = f.read(min(READ_BYTES, left))
                if not data:
                    raise OSError(f"{m.path} shrank while it was being sent")
                left -= len(data)
                yield data
            if pad := _padded(m.size) - m.size:
                yield b"\0" * pad
        yield b"\0" * (2 * BLOCK)  # the end-of-archive marker
    finally:
        for f in handles:
            f.close()


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK
