"""What the benchmarks share: the machine's load, medians, reading a child process's last
JSON line, and what every benchmark prints last (the load around the run, then one JSON
line); the dtype every recipe of a benchmark runs in (`bench_dtype`, and what it means for
torch, DeepSpeed and FSDP2), what a recipe was seen computing in, and the peak memory a
block of code adds."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console


def finish(
    console: Console,
    result: dict[str, Any],
    load_before: Sequence[float],
    load_after: Sequence[float],
    json_out: bool,
    extra: str = "",
) -> dict[str, Any]:
    """Print the load line (and `extra`, and the dtype, CPU capability and torch threads
    if `result` has `machine`'s keys), then the result as one JSON line if asked."""
    fmt = ", ".join
    if "compute_dtype" in result and "cpu_capability" in result:
        extra += (
            f"{result['compute_dtype']} on CPU {result['cpu_capability']}, torch threads "
            f"{result.get('torch_threads')}; "
        )
    console.print(
        f"load avg (1/5/15 min) before {fmt(f'{v:.2f}' for v in load_before)}; "
        f"after {fmt(f'{v:.2f}' for v in load_after)}; {extra}cpus {os.cpu_count()}"
    )
    if json_out:
        print(json.dumps(result))
    return result


def load_avg() -> list[float]:
    """The 1/5/15-minute load averages, rounded: what else the machine was doing."""
    return [round(v, 2) for v in os.getloadavg()]


def median(xs: Sequence[float]) -> float:
    """The median, NaN for no samples (a run that produced none is visible, not an error)."""
    return statistics.median(xs) if xs else float("nan")


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of a child's output that is a JSON object, if any."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def machine(compute_dtype: str) -> dict[str, Any]:
    """What every benchmark's JSON says about the machine it ran on: the dtype it computed
    in, the CPU's vector ISA as torch uses it, whether that CPU computes bf16 natively, and
    torch's thread count (a figure compares only with figures of the same machine)."""
    import torch

    from pstar_core.precision import cpu_capability, cpu_flags_promise_bf16

    return {
        "compute_dtype": compute_dtype,
        "cpu_capability": cpu_capability(),
        "cpu_flags_bf16": cpu_flags_promise_bf16(),
        "torch_threads": torch.get_num_threads(),
    }


def bench_dtype(requested: str) -> str:
    """A benchmark's `--dtype`: as given, or 'auto' resolved as the engine resolves it
    on this CPU, so the peers (plain torch, FSDP2, DeepSpeed) run in the same dtype."""
    import torch

    from pstar_core.precision import AUTO, decide

    if requested not in (AUTO, "fp32", "bf16", "fp16"):
        raise ValueError(f"--dtype must be auto, fp32, bf16 or fp16, got {requested!r}")
    return decide(requested, torch.device("cpu")).dtype if requested == AUTO else requested


DTYPE_NAMES = ("fp32", "bf16", "fp16")


def torch_dtype(name: str) -> Any:
    """The torch dtype of a benchmark dtype name."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def dtype_name(dtype: Any) -> str:
    """The benchmark name of a torch dtype (its str for any other dtype)."""
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return names.get(dtype, str(dtype))


def deepspeed_precision(dtype: str) -> dict[str, Any]:
    """The part of a DeepSpeed config that makes it train in `dtype`: its bf16 or fp16
    section enabled, neither for fp32 (DeepSpeed's default)."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    return {} if dtype == "fp32" else {dtype: {"enabled": True}}


def fsdp2_precision(dtype: str) -> Any:
    """FSDP2's `MixedPrecisionPolicy` for `dtype`: params cast to it for forward and
    backward, gradients reduced in fp32; in fp32 no casting at all."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch_dtype(dtype), reduce_dtype=torch.float32)


def watch_compute_dtype(module: Any) -> Callable[[], str | None]:
    """What `module` computes in, as seen: the output dtype of its first linear layer in
    the last forward (None before one). A recipe's parameters need not say it: FSDP2's
    `MixedPrecisionPolicy` keeps fp32 shards and casts only for the forward."""
    import torch

    first = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    seen: list[str] = []
    if first is not None:

        def hook(_mod: Any, _args: Any, out: Any) -> None:
            seen[:] = [dtype_name(out.dtype)]

        first.register_forward_hook(hook)
    return lambda: seen[0] if seen else None


def _status_bytes(key: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    return None


@contextlib.contextmanager
def peak_rss_growth() -> Iterator[dict[str, Any]]:
    """How far this process's peak resident memory (VmHWM) rose during the block, in
    `out["bytes"]` once it ends (None off Linux).

    The peak is first reset to the current RSS (`/proc/self/clear_refs`, Linux >= 4.0),
    so an earlier, higher peak (imports, a model built before) does not hide the block's:
    `bytes` is then the block's peak minus what the process held when it began. Where the
    reset is refused, it is the rise above the earlier peak, a lower bound (`"reset":
    False`). `prior_peak_bytes` is the peak before the reset, for a caller that also
    reports the whole process's peak. `new_modules`: how many modules the block imported
    (a first call that imports a library pays for it here)."""
    import sys

    out: dict[str, Any] = {"prior_peak_bytes": _status_bytes("VmHWM")}
    modules = len(sys.modules)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS only
        out["reset"] = True
    except OSError:
        out["reset"] = False
    before = _status_bytes("VmHWM")
    try:
        yield out
    finally:
        after = _status_bytes("VmHWM")
        out["bytes"] = None if before is None or after is None else max(0, after - before)
        out["new_modules"] = len(sys.modules) - modules


def fake_device(bench: str) -> Any:
    """The test suite's second device (`tests/fakedevice`), from this checkout: loaded,
    its module returned. `bench` names the caller in the error of an installed package
    without the tests."""
    import sys

    root = Path(__file__).resolve().parents[1]
    if (root / "tests" / "fakedevice").is_dir() and str(root) not in sys.path:
        sys.path.append(str(root))
    try:
        from tests import fakedevice
    except ImportError as e:
        raise ValueError(
            f"{bench} runs on the test suite's fake device: run it from a checkout of this "
            f"repository ({e})"
        ) from None
    return fakedevice.load()
