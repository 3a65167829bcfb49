"""DPO: preference lines validated at upload, pairs tokenized with the answer as the only
trained message, and the objective's per-step losses against an independent plain-PyTorch
DPO (a frozen copy of the model as the reference, torch's AdamW), in fp32, for full
fine-tuning and for LoRA (whose reference is the base with the adapters disabled)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from service.data.datasets import IGNORE, LineValidator
from service.methods.dpo_objective import DPO
from service.methods.objectives import Split
from tests.core.helpers import torch_adamw

BETA = 0.5
STEPS = 10


def pair(prompt: str = "hi", good: str = "yes", bad: str = "no", **extra) -> dict:
    return {
        "input": {"messages": [{"role": "user", "content": prompt}]},
        "preferred_output": [{"role": "assistant", "content": good}],
        "non_preferred_output": [{"role": "assistant", "content": bad}],
        **extra,
    }


def validate(*objs) -> LineValidator:
    v = LineValidator()
    for o in objs:
        v.feed(json.dumps(o).encode())
    return v


def test_preference_lines_are_their_own_format():
    v = validate(pair(), pair("a", "b", "c"))
    assert (v.check.format, v.check.examples, v.check.error_count) == ("preference", 2, 0)


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        (pair(good="same", bad="same"), "are the same answer"),
        ({**pair(), "preferred_output": []}, "'preferred_output' must be a list of one"),
        (
            {**pair(), "non_preferred_output": [{"role": "user", "content": "x"}]},
            "non_preferred_output[0].role must be 'assistant'",
        ),
        ({**pair(), "input": {"messages": []}}, "input.messages must be a non-empty list"),
        (
            {**pair(), "input": {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}},
            'input.tools[0] must be {"type": "function"',
        ),
        (
            {
                **pair(),
                "input": {
                    "messages": [
                        {"role": "user", "content": "x"},
                        {"role": "assistant", "content": "y"},
                    ]
                },
            },
            "ends with an assistant message",
        ),
        (pair(score=1), "unknown key(s) ['score']"),
    ],
)
def test_a_bad_preference_line_is_refused_with_its_number_and_reason(obj, says):
    v = validate(pair(), obj)
    assert v.check.error_count == 1
    err = v.check.errors[0]
    assert err.line == 2
    assert says in err.reason


def test_a_pair_trains_only_on_each_answer(tmp_path):
    from transformers import AutoTokenizer

    from service.data.preference import pair_rows
    from service.data.tokens import tokenize
    from tests.tiny import make_tiny_llama

    tok = AutoTokenizer.from_pretrained(make_tiny_llama(tmp_path / "m"))
    ex = pair("What does apple mean?", "apple is a word", "a river")
    enc = pair_rows(tok, tokenize(tok, "preference", [ex]), 48)
    assert enc.input_ids.shape == (1, 2, 48)
    for side, answer in ((0, "apple is a word"), (1, "a river")):
        labels = enc.labels[0, side]
        trained = tok.decode(labels[labels != IGNORE])
        assert trained.startswith(answer)  # the answer (and its end-of-turn), no prompt
        assert "What does" not in trained
    assert enc.report()["rows"] == 1


# -- the objective against plain PyTorch -----------------------------------------------------

VOCAB, SEQ, PAIRS, BATCH = 64, 24, 16, 4


def tiny_llama():
    from tests.core.helpers import tiny_hf_llama

    torch.manual_seed(0)
    return tiny_hf_llama(positions=SEQ, vocab=VOCAB)


def pairs_split() -> Split:
    """Pairs sharing a prompt (labels ignored) with two answers of different lengths,
    right-padded; the answers are learnable patterns so the policy can move."""
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(PAIRS, 2, SEQ, dtype=torch.long)
    labels = torch.full((PAIRS, 2, SEQ), IGNORE)
    lengths = torch.zeros(PAIRS, dtype=torch.long)
    for i in range(PAIRS):
        prompt = torch.randint(1, VOCAB, (6,), generator=g)
        for side in (0, 1):
            n = int(torch.randint(4, SEQ - 6, (1,), generator=g))
            answer = (torch.arange(n) * (side + 1) + i) % (VOCAB - 1) + 1
            row = torch.cat([prompt, answer])
            ids[i, side, : len(row)] = row
            labels[i, side, 6 : len(row)] = answer
            lengths[i] += len(row)
    return Split(ids, labels, lengths)


def step_indices(step: int) -> torch.Tensor:
    return torch.arange(BATCH) + (step * BATCH) % PAIRS


def plain_dpo_losses(model, split: Split, lr: float, params=None) -> list[float]:
    """DPO written here from the paper: a frozen deep copy as the reference, log-softmax
    and gather for the answers' log-probabilities, torch's AdamW."""
    policy = copy.deepcopy(model)
    reference = copy.deepcopy(model).eval()
    trainable = [p for n, p in policy.named_parameters() if params is None or n in params]
    opt = torch_adamw(policy, lr, 0.0, trainable)

    def logps(m, ids, labels):
        logits = m(input_ids=ids.flatten(0, 1)).logits.view(*ids.shape, -1)
        lp = torch.log_softmax(logits[..., :-1, :].double(), dim=-1)
        tgt = labels[..., 1:]
        mask = tgt != IGNORE
        picked = lp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (picked * mask).sum(-1)  # (pairs, 2)

    losses = []
    for step in range(STEPS):
        idx = step_indices(step)
        ids, labels = split.ids[idx], split.labels[idx]
        with torch.no_grad():
            ref = logps(reference, ids, labels)
        pol = logps(policy, ids, labels)
        z = BETA * ((pol[:, 0] - ref[:, 0]) - (pol[:, 1] - ref[:, 1]))
        loss = -F.logsigmoid(z).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


class Sink:
    def phase(self, detail: str) -> None:
        pass

    def event(self, message: str, **data) -> None:
        self.said = message


def engine_dpo_losses(engine, split: Split, tmp_path, lora: bool) -> list[float]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    dpo = DPO(BETA, lora, tmp_path / "rows.ref.pt")
    dpo.prepare(engine, {"train": split}, 0, 1, BATCH, Sink())
    assert (tmp_path / "rows.ref.pt").is_file()  # kept with the prepared data
    losses = []
    for step in range(STEPS):
        sums = dpo.train_step(engine, split.rows(step_indices(step), engine.device), 1)
        assert sums["count"] == BATCH
        losses.append(sums["loss_sum"] / sums["count"])
    return losses


CFG = {
    "dtype": "fp32",
    "chunk_size": 8192,
    "optimizer": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
}
# fp32 on both sides, the same terms summed in other orders (the engine's chunked AdamW
# against torch's, fp32 against fp64 log-softmax on 24 tokens): relative differences of
# ~1e-7 per step that compound over 10 steps to ~1e-6; the engine's own fp32 parity test
# with torch's AdamW (tests/core/test_engine.py) holds 1e-5 over 20 steps, as here
RTOL = 1e-5


def test_dpo_losses_match_plain_pytorch_over_ten_steps_full_fine_tuning(tmp_path):
    import pstar_core

    split = pairs_split()
    model = tiny_llama()
    want = plain_dpo_losses(model, split, lr=1e-2)
    with pstar_core.initialize(lambda: copy.deepcopy(model), CFG) as engine:
        got = engine_dpo_losses(engine, split, tmp_path, lora=False)
    assert got[0] == pytest.approx(-F.logsigmoid(torch.tensor(0.0)).item(), rel=1e-6)  # ln 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)
    assert got[-1] < got[0] - 0.05  # it learned: the loss fell from ln 2


def test_dpo_losses_match_plain_pytorch_with_lora_and_the_base_as_reference(tmp_path):
    import peft

    import pstar_core

    split = pairs_split()
    base = tiny_llama()
    lora_cfg = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    # plain: peft's model, only the adapters train; the reference is the base itself
    torch.manual_seed(1)
    plain = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    # B starts at zero, so the LoRA model at step 0 is the base: the reference of both
    adapters = {n for n, p in plain.named_parameters() if p.requires_grad}
    want = plain_dpo_losses(plain, split, lr=1e-2, params=adapters)
    tmp_path.joinpath("base").mkdir()
    base.save_pretrained(tmp_path / "base")
    cfg = {**CFG, "lora": lora_cfg}
    with pstar_core.initialize(tmp_path / "base", cfg) as engine:
        # the adapters as peft made them for the plain run (A random, B zero)
        sd = {n: p for n, p in plain.state_dict().items() if "lora_" in n}
        engine.load_state_dict({**engine.state_dict(), **sd})
        got = engine_dpo_losses(engine, split, tmp_path, lora=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)
    assert got[-1] < got[0]


def test_lora_reference_is_the_base_even_after_training(tmp_path):
    """With the adapters disabled the reference pass sees the base, whatever the adapters
    have learned: a pass run late (its file lost) gives the first pass's numbers."""
    import pstar_core

    split = pairs_split()
    tiny_llama().save_pretrained(tmp_path / "base")
    cfg = {**CFG, "lora": {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj"]}}
    with pstar_core.initialize(tmp_path / "base", cfg) as engine:
        losses = engine_dpo_losses(engine, split, tmp_path, lora=True)
        first = torch.load(tmp_path / "rows.ref.pt", weights_only=True)["train"]
        (tmp_path / "rows.ref.pt").unlink()
        again = Split(split.ids, split.labels, split.lengths)
        DPO(BETA, True, tmp_path / "rows.ref.pt").prepare(
            engine, {"train": again}, 0, 1, BATCH, Sink()
        )
    assert losses[-1] < losses[0]  # the adapters moved
    # yet the reference is the same: the base, in the same batches, bit for bit
    torch.testing.assert_close(again.reference, first, rtol=0, atol=0)


def test_full_fine_tuning_refuses_to_recompute_a_lost_reference_after_training(tmp_path):
    import pstar_core

    split = pairs_split()
    model = tiny_llama()
    with pstar_core.initialize(lambda: copy.deepcopy(model), CFG) as engine:
        engine_dpo_losses(engine, split, tmp_path, lora=False)
        (tmp_path / "rows.ref.pt").unlink()
        with pytest.raises(RuntimeError, match="cannot be computed again"):
            DPO(BETA, False, tmp_path / "rows.ref.pt").prepare(
                engine, {"train": split}, 0, 1, BATCH, Sink()
            )


def test_dpo_under_an_evicting_device_budget_gives_bitwise_the_same_losses(tmp_path):
    """40% of the param chunks on the device beside the measured activations: chunks are
    evicted and fetched back every step, the losses do not change by a bit."""
    import pstar_core

    split = pairs_split()
    model = tiny_llama()
    cfg = {**CFG, "chunk_size": 2048}
    with pstar_core.initialize(lambda: copy.deepcopy(model), cfg) as engine:
        roomy = engine_dpo_losses(engine, split, tmp_path / "roomy", lora=False)
        st = engine.stats()
    budget = int(st["tracer"]["peak_non_model_bytes"] + 0.4 * st["chunks"]["param"]["bytes"])
    tight = {**cfg, "memory": {"device_budget": budget}}
    with pstar_core.initialize(lambda: copy.deepcopy(model), tight) as engine:
        evicting = engine_dpo_losses(engine, split, tmp_path / "tight", lora=False)
        st = engine.stats()
        peak = engine.manager.residency.tiers["device"].peak_bytes
    assert evicting == roomy
    assert st["bytes_moved"]["device->host"] > 0  # the budget really forced evictions
    assert peak <= budget


def test_dpo_on_two_ranks_matches_plain_pytorch(tmp_path):
    """Chunk ZeRO over 2 gloo ranks, each with half of every batch of pairs: the reference
    pass shares the pairs out and sums them back, the losses (averaged over the ranks)
    match plain PyTorch as one rank's do."""
    from tests.core.helpers import spawn_ranks

    want = plain_dpo_losses(tiny_llama(), pairs_split(), lr=1e-2)
    results = spawn_ranks("tests.service.dpo_worker", 2, tmp_path)
    assert results[0]["reference"] == results[1]["reference"]  # every rank has every pair's
    assert results[0]["losses"] == results[1]["losses"]
    torch.testing.assert_close(
        torch.tensor(results[0]["losses"]), torch.tensor(want), rtol=RTOL, atol=0
    )
