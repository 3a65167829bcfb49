"""service/data/prepare, tokens and rows: a job's data streamed from its file to `.npy` rows
on disk, the same rows the in-memory path makes, made a piece at a time, with the tokens
waiting on disk; and the worker's view of them (`load_rows`, `Split`)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.data import rows as rows_mod
from service.data import tokens as tokens_mod
from service.data.prepare import prepare, prepare_files
from service.data.rows import load_rows
from service.data.tokens import TokenWriter
from service.methods.objectives import Split
from service.spec.job import JobSpec

WORDS = [
    "apple",
    "river",
    "stone",
    "light",
    "green",
    "quick",
    "the",
    "of",
    "to",
    "and",
    "a",
    "in",
    "is",
    "it",
]


def _sentence(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, most)))


def write_file(path: Path, fmt: str, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        user = {"role": "user", "content": _sentence(rng, 20)}
        if fmt == "chat":
            answer = {"role": "assistant", "content": _sentence(rng, 30)}
            lines.append(json.dumps({"messages": [user, answer]}))
        elif fmt == "preference":
            yes = [{"role": "assistant", "content": "yes " + _sentence(rng, 20)}]
            no = [{"role": "assistant", "content": "no " + _sentence(rng, 20)}]
            pair = {"input": {"messages": [user]}, "preferred_output": yes}
            lines.append(json.dumps({**pair, "non_preferred_output": no}))
        else:
            lines.append(_sentence(rng, 60))
    path.write_text("\n".join(lines) + "\n")
    return path


def spec(fmt: str, n: int, packing: Any = "auto", seq_len: Any = "auto") -> JobSpec:
    return JobSpec.model_validate(
        {
            "version": 1,
            "base_model": "gpt-tiny",
            "method": {"type": "dpo" if fmt == "preference" else "supervised"},
            "model": {"id": "gpt-tiny", "kind": "zoo", "path": None},
            "training_file": {"id": "file-1", "format": fmt, "examples": n},
            "hyperparameters": {
                "n_epochs": 1,
                "batch_size": 4,
                "learning_rate_multiplier": 1.0,
                "learning_rate": 1e-4,
                "seq_len": seq_len,
                "packing": packing,
            },
        }
    )


CASES = [("chat", True), ("chat", False), ("preference", "auto"), ("text", "auto")]


@pytest.mark.parametrize(("fmt", "packing"), CASES)
def test_a_jobs_rows_on_disk_are_the_rows_made_in_memory(tmp_path, fmt, packing):
    train = write_file(tmp_path / "train.jsonl", fmt, 60)
    valid = write_file(tmp_path / "valid.jsonl", fmt, 12, seed=1)
    s = spec(fmt, 60, packing=packing, seq_len=32 if fmt == "text" else "auto")
    in_memory = prepare(s, train, valid, tokenizer_cache=tmp_path / "tok")
    data_file = tmp_path / "job" / "data" / "rows-abc"
    meta = prepare_files(s, train, valid, tmp_path / "tok", data_file)
    assert "error" not in meta
    assert json.loads(data_file.with_suffix(".json").read_text()) == meta
    # only the rows and their report are left: no tokens, no half-written directory
    assert sorted(p.name for p in data_file.parent.iterdir()) == ["rows-abc", "rows-abc.json"]
    on_disk = load_rows(data_file)
    for split, enc in (("train", in_memory.train), ("valid", in_memory.valid)):
        assert enc is not None
        want = {"ids": enc.input_ids, "labels": enc.labels, "lengths": enc.lengths}
        if enc.position_ids is not None:
            want["position_ids"] = enc.position_ids
        assert {k for k in on_disk if k.startswith(split)} == {f"{split}_{k}" for k in want}
        for k, v in want.items():
            assert on_disk[f"{split}_{k}"].dtype == torch.int32
            assert torch.equal(on_disk[f"{split}_{k}"], v), (split, k)
    assert meta["training_file"] == in_memory.train.report()
    assert meta["training_file"]["packed"] == (packing is True)


def test_rows_are_made_a_piece_at_a_time_and_come_out_the_same(tmp_path, monkeypatch):
    train = write_file(tmp_path / "train.jsonl", "chat", 50)
    s = spec("chat", 50, packing=True)
    whole = prepare(s, train, None, tokenizer_cache=tmp_path / "tok")
    written: list[int] = []
    write = rows_mod.Column.write

    def counted(self, piece):
        written.append(len(piece))
        write(self, piece)

    monkeypatch.setattr(rows_mod, "PIECE", 3)
    monkeypatch.setattr(rows_mod.Column, "write", counted)
    prepare_files(s, train, None, tmp_path / "tok", tmp_path / "rows")
    assert max(written) == 3  # no array was written whole
    got = load_rows(tmp_path / "rows")
    assert torch.equal(got["train_ids"], whole.train.input_ids)
    assert torch.equal(got["train_position_ids"], whole.train.position_ids)
    assert torch.equal(got["train_labels"], whole.train.labels)


def test_tokens_wait_on_disk_in_blocks_and_map_back(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens_mod, "FLUSH_TOKENS", 16)
    w = TokenWriter(tmp_path / "t")
    examples = [(list(range(k, k + 5 + k % 4)), [0, 0] + [1] * (3 + k % 4)) for k in range(40)]
    held = []
    for ids, mask in examples:
        w.add(ids, mask)
        held.append(len(w._ids))
    assert max(held) < 16 + 9  # a block and one example, never the whole stream
    t = w.finish()
    assert isinstance(t.ids, np.memmap)
    assert (tmp_path / "t" / "ids.bin").stat().st_size == 4 * sum(len(i) for i, _ in examples)
    assert len(t) == 40
    for k in (0, 17, 39):
        ids, mask = t.example(k, len(examples[k][0]))
        assert ids.tolist() == examples[k][0]
        assert mask.tolist() == examples[k][1]
    assert t.first_loss.tolist() == [2] * 40


def test_a_loss_mask_that_does_not_fit_its_ids_is_refused(tmp_path):
    with pytest.raises(ValueError, match="loss mask of 3 entries"):
        TokenWriter().add([1, 2, 3], [1])


def test_the_worker_reads_int32_rows_as_the_model_takes_them(tmp_path):
    train = write_file(tmp_path / "train.jsonl", "chat", 20)
    prepare_files(spec("chat", 20, packing=True), train, None, tmp_path / "tok", tmp_path / "r")
    data = load_rows(tmp_path / "r")
    split = Split.of(data, "train")
    assert split is not None
    assert Split.of(data, "valid") is None
    picked = split.rows(torch.tensor([1, 0]), torch.device("cpu"))
    assert picked.input_ids.dtype == picked.labels.dtype == torch.long
    assert picked.position_ids is not None
    assert picked.position_ids.dtype == torch.long
    assert torch.equal(picked.input_ids, data["train_ids"][[1, 0]].long())
    # the rows are mapped copy-on-write: a worker's writes never reach the file
    data["train_ids"][0, 0] = -7
    assert int(load_rows(tmp_path / "r")["train_ids"][0, 0]) != -7


def test_unusable_data_leaves_nothing_behind(tmp_path):
    train = write_file(tmp_path / "train.jsonl", "text", 3)
    s = spec("text", 3, seq_len=512)  # three short lines fill no row of 512 tokens
    meta = prepare_files(s, train, None, tmp_path / "tok", tmp_path / "data" / "rows")
    assert "shorter than one row" in meta["error"]
    assert list((tmp_path / "data").iterdir()) == []
