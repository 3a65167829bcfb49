"""service/data/packing: several examples per row, and a packed example's loss equal to the same
example's loss in a row of its own (the model sees the same positions and attends to
nothing outside it), for a Llama (rotary positions) and a GPT-2 (learned positions), with
SDPA and eager attention, through transformers and through the engine."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from service.data.datasets import IGNORE
from service.data.packing import pack, padding_share
from service.data.rows import to_rows
from service.spec import auto
from service.spec.auto import AUTO_PADDING_SHARE


class Tok:
    pad_token_id, eos_token_id = 0, 1


def examples(n: int, seed: int = 0, vocab: int = 90, longest: int = 24):
    """`n` examples of random lengths; the loss is on the second half of each."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(3, longest)
        ids = [rng.randrange(2, vocab) for _ in range(length)]
        half = length // 2
        out.append((ids, [0] * half + [1] * (length - half)))
    return out


def test_every_example_lands_once_whole_with_positions_restarting_at_it():
    ex = examples(60)
    enc = pack(Tok(), ex, seq_len=32)
    assert enc.input_ids.shape == enc.labels.shape == enc.position_ids.shape
    assert enc.input_ids.shape[1] == 32
    found = []
    for r in range(enc.input_ids.shape[0]):
        pos, ids, labels = (t[r].tolist() for t in (enc.position_ids, enc.input_ids, enc.labels))
        starts = [i for i, p in enumerate(pos) if p == 0] + [32]
        n = int(enc.lengths[r])
        for a, b in itertools.pairwise(starts):
            if a >= n:  # the padding at the row's end: a block of its own, no labels
                assert ids[a:] == [Tok.pad_token_id] * (32 - a)
                assert labels[a:] == [IGNORE] * (32 - a)
                assert pos[a:] == list(range(32 - a))
                break
            found.append((ids[a:b], labels[a:b]))
            assert pos[a:b] == list(range(b - a))
    assert len(found) == len(ex)
    want = sorted(
        (ids, [IGNORE] + [t if m else IGNORE for t, m in zip(ids[1:], mask[1:], strict=True)])
        for ids, mask in ex
    )
    assert sorted(found) == want


def test_packing_fills_rows_far_better_than_one_example_per_row():
    ex = examples(200, longest=30)
    packed, padded = pack(Tok(), ex, 64), to_rows(Tok(), ex, 64)
    assert packed.tokens == padded.tokens
    assert packed.loss_tokens == padded.loss_tokens
    rp, rq = packed.report(), padded.report()
    assert rq["rows"] == 200
    assert rq["examples_per_row"] == 1.0
    assert not rq["packed"]
    assert rp["packed"]
    assert rp["rows"] < rq["rows"] / 3
    assert rp["examples_per_row"] == pytest.approx(200 / rp["rows"])
    # the fill is the real tokens over the slots, and best-fit leaves at most one row
    # (in effect) part-empty beyond what the sizes force
    assert rp["fill_ratio"] == pytest.approx(packed.tokens / (rp["rows"] * 64))
    assert rp["fill_ratio"] > 0.95
    assert rq["fill_ratio"] == pytest.approx(1 - padding_share(ex, 64))


def test_packing_is_deterministic_and_keeps_long_examples_cut_as_unpacked():
    ex = examples(50, longest=40)
    a, b = pack(Tok(), ex, 16), pack(Tok(), ex, 16)
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.position_ids, b.position_ids)
    unpacked = to_rows(Tok(), ex, 16)
    assert (a.truncated, a.dropped, a.tokens) == (
        unpacked.truncated,
        unpacked.dropped,
        unpacked.tokens,
    )
    assert a.truncated > 0


def test_auto_packs_only_when_more_than_a_third_would_be_padding():
    full = [([5] * 30, [1] * 30)] * 4  # 30 of 32 slots used: 6% padding
    short = [([5] * 10, [1] * 10)] * 4  # 10 of 32: 69% padding
    assert padding_share(full, 32) < AUTO_PADDING_SHARE < padding_share(short, 32)
    assert not auto.packing("auto", padding_share(full, 32))
    assert auto.packing("auto", padding_share(short, 32))
    assert auto.packing(True, padding_share(full, 32))
    assert not auto.packing(False, padding_share(short, 32))


# -- the model sees each packed example as it would alone -----------------------------------


def tiny_model(kind: str, attn: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.core.helpers import tiny_hf_llama

    torch.manual_seed(0)
    if kind == "llama":
        return tiny_hf_llama(positions=64, vocab=96, attn=attn).eval()
    cfg = GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    cfg._attn_implementation = attn
    return GPT2LMHeadModel(cfg).eval()


def per_example_losses(logits: torch.Tensor, labels: torch.Tensor, starts) -> list[float]:
    """Mean next-token loss of each example, from a row's logits and labels; `starts` are
    (row, first position, end) of each example in the batch."""
    out = []
    for r, a, b in starts:
        lg, tg = logits[r, a : b - 1], labels[r, a + 1 : b].long()  # rows are int32
        keep = tg != IGNORE
        out.append(torch.nn.functional.cross_entropy(lg[keep].double(), tg[keep]).item())
    return out


def spans(enc) -> list[tuple[int, int, int]]:
    """(row, start, end) of every example of packed rows, in row order."""
    out = []
    for r in range(enc.input_ids.shape[0]):
        pos = enc.position_ids[r].tolist()
        n = int(enc.lengths[r])
        starts = [i for i, p in enumerate(pos[:n]) if p == 0] + [n]
        out += [(r, a, b) for a, b in itertools.pairwise(starts)]
    return out


def example_of(enc, r: int, a: int, b: int) -> list[int]:
    return enc.input_ids[r, a:b].tolist()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_packed_examples_loss_equals_its_loss_alone(kind, attn):
    ex = examples(24, seed=1, vocab=96, longest=20)
    enc = pack(Tok(), ex, 48)
    assert enc.report()["examples_per_row"] > 2  # really packed
    model = tiny_model(kind, attn)
    with torch.no_grad():
        packed = model(
            input_ids=enc.input_ids, position_ids=enc.position_ids, use_cache=False
        ).logits
        got = per_example_losses(packed, enc.labels, spans(enc))
        # each example alone, right-padded in a row of its own (the unpacked layout)
        want = []
        for r, a, b in spans(enc):
            ids = example_of(enc, r, a, b)
            alone = to_rows(Tok(), [(ids, [0] + [1] * (len(ids) - 1))], 48)
            logits = model(input_ids=alone.input_ids).logits
            labels = alone.labels.clone()
            labels[0, 1 : b - a] = enc.labels[r, a + 1 : b]  # the same targets as packed
            want += per_example_losses(logits, labels, [(0, 0, b - a)])
    # fp32 forwards of the same example along two attention paths (a block-diagonal mask
    # against plain causal, over other lengths): each sum is reordered, which moves a
    # logit by a few ulp (~1e-7 relative) and the loss, an average of log-softmaxes, by as
    # little; 1e-5 leaves two orders of magnitude of margin, and the leak below is > 1e-3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    # and the mask matters: without the restarted positions (one long sequence per row)
    # later examples would attend to earlier ones and the losses would differ
    with torch.no_grad():
        leaky = per_example_losses(model(input_ids=enc.input_ids).logits, enc.labels, spans(enc))
    assert max(abs(x - y) for x, y in zip(leaky, want, strict=True)) > 1e-3


def test_the_engine_trains_packed_rows_with_the_loss_of_the_examples_alone():
    """One step through the engine (supervised objective) on packed rows: its loss is the
    token-weighted mean of the examples' losses alone, as plain transformers gives them."""
    import pstar_core
    from service.methods.objectives import Split, Supervised

    ex = examples(12, seed=2, vocab=96, longest=20)
    enc = pack(Tok(), ex, 48)
    model = tiny_model("llama", "sdpa")
    with torch.no_grad():
        want_sum = want_count = 0.0
        for r, a, b in spans(enc):
            ids = example_of(enc, r, a, b)
            logits = model(input_ids=torch.tensor([ids])).logits
            tg = enc.labels[r, a + 1 : b].long()
            keep = tg != IGNORE
            want_sum += torch.nn.functional.cross_entropy(
                logits[0, :-1][keep].double(), tg[keep], reduction="sum"
            ).item()
            want_count += int(keep.sum())
    cfg = {"dtype": "fp32", "chunk_size": 4096, "optimizer": {"lr": 1e-3}}
    # the engine takes the model's own weights into its chunks
    # the worker's path: a `Split`'s rows, widened to int64 (`Split.rows`)
    split = Split(enc.input_ids, enc.labels, enc.lengths, enc.position_ids)
    with pstar_core.initialize(lambda: model.train(), cfg) as engine:
        rows = split.rows(torch.arange(len(split)), engine.device)
        sums = Supervised().train_step(engine, rows, micro_batches=1)
    assert sums["count"] == want_count
    # as above: the same fp32 terms along another attention path, a few ulp each
    assert sums["loss_sum"] / sums["count"] == pytest.approx(want_sum / want_count, rel=1e-5)
