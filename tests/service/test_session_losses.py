"""service/sessions/losses: Tinker's forward and forward_backward on the engine, against
transformers and plain PyTorch: the base's log-probabilities, each loss's formula from the
returned log-probabilities, the update one optimizer step makes, and what is refused."""

from __future__ import annotations

import copy

import pytest
import torch

import pstar_core
from service.sessions.losses import BadInput, Datum, Unsupported, run
from tests.core.helpers import tiny_hf_llama

VOCAB = 64
ADAM = pstar_core.StepHyper(lr=1e-2, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)


def model():
    torch.manual_seed(0)
    return tiny_hf_llama(vocab=VOCAB)


def engine_of(m):
    return pstar_core.initialize(lambda: copy.deepcopy(m), {"dtype": "fp32", "chunk_size": 8192})


def sequences(n: int = 3, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(6 + 3 * k),), generator=g).tolist() for k in range(n)]


def shifted(seq: list[int], **inputs) -> Datum:
    """Tinker's alignment: the input is the sequence but its last token, the targets are
    the sequence but its first."""
    return Datum(seq[:-1], {"target_tokens": seq[1:], **inputs})


def reference_logprobs(m, seqs) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for seq in seqs:
            logits = m(input_ids=torch.tensor([seq[:-1]])).logits[0].float()
            out.append(
                torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            )
    return out


def test_forward_gives_the_bases_logprobs_for_every_datum_of_a_ragged_batch():
    m, seqs = model(), sequences()
    with engine_of(m) as engine:
        out = run(
            engine,
            [shifted(s, weights=[1.0] * (len(s) - 1)) for s in seqs],
            "cross_entropy",
            backward=False,
        )
    want = reference_logprobs(m, seqs)
    assert [len(lp) for lp in out.logprobs] == [len(s) - 1 for s in seqs]
    for got, w in zip(out.logprobs, want, strict=True):
        torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(-sum(float(w.sum()) for w in want), rel=1e-5)


def test_cross_entropy_steps_exactly_as_torch_adamw_on_the_weighted_sum():
    m, seqs = model(), sequences()
    weights = [[float(i % 2) for i in range(len(s) - 1)] for s in seqs]  # half the tokens
    data = [shifted(s, weights=w) for s, w in zip(seqs, weights, strict=True)]
    ref = copy.deepcopy(m)
    opt = torch.optim.AdamW(
        ref.parameters(),
        lr=ADAM.lr,
        betas=ADAM.betas,
        eps=ADAM.eps,
        weight_decay=0.0,
        foreach=False,
    )
    with engine_of(m) as engine:
        losses = []
        for _ in range(3):
            out = run(engine, data, "cross_entropy")
            engine.step(ADAM)
            losses.append(out.metrics["loss:sum"])
            total = 0.0
            for s, w in zip(seqs, weights, strict=True):
                logits = ref(input_ids=torch.tensor([s[:-1]])).logits[0]
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
                total = total - (torch.tensor(w) * lp).sum()
            assert out.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-5)
            total.backward()
            opt.step()
            opt.zero_grad()
        after = run(engine, data, "cross_entropy", backward=False)
    assert losses[-1] < losses[0]  # the weighted NLL falls
    want = reference_logprobs(ref, seqs)
    for got, w in zip(after.logprobs, want, strict=True):
        torch.testing.assert_close(torch.tensor(got), w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_policy_losses_equal_their_formulas_from_the_returned_logprobs(loss_fn):
    m, seqs = model(), sequences()
    g = torch.Generator().manual_seed(5)
    base = reference_logprobs(m, seqs)
    # the sampler's log-probabilities: off by up to +-0.5, so some ratios leave [0.8, 1.2]
    sampled = [(b + (torch.rand(len(b), generator=g) - 0.5)).tolist() for b in base]
    adv = [(torch.randn(len(b), generator=g)).tolist() for b in base]
    data = [
        shifted(s, logprobs=q, advantages=a) for s, q, a in zip(seqs, sampled, adv, strict=True)
    ]
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1} if loss_fn == "ppo" else None
    with engine_of(m) as engine:
        out = run(engine, data, loss_fn, config)
    want = 0.0
    clipped = 0
    for lp, q, a in zip(out.logprobs, sampled, adv, strict=True):
        ratio = torch.exp(torch.tensor(lp) - torch.tensor(q))
        a_ = torch.tensor(a)
        if loss_fn == "importance_sampling":
            want -= float((ratio * a_).sum())
        else:
            c = torch.clamp(ratio, 0.9, 1.1)
            clipped += int((c != ratio).sum())
            want -= float(torch.minimum(ratio * a_, c * a_).sum())
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)
    if loss_fn == "ppo":
        assert clipped > 0  # the clip was exercised


def _policy_formula(loss_fn: str, lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor, cfg):
    """Tinker's documented per-sequence loss (autograd through `lp`)."""
    ratio = torch.exp(lp - q)
    if loss_fn == "gspo":  # GSPO-token, as Tinker's page writes it
        log_ratio = (lp.detach() - q)[_marked(len(lp))].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -torch.minimum(ratio * a, clipped * a).sum()
    if loss_fn == "cispo":
        low, high = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
        return -(torch.clamp(ratio, low, high).detach() * lp * a).sum()
    return -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()  # dro


def _marked(n: int) -> torch.Tensor:
    """A gspo datum's sequence_ratio_mask: its first two positions are the prompt's."""
    return torch.arange(n) >= 2


@pytest.mark.parametrize(
    ("loss_fn", "cfg"),
    [("cispo", {}), ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
     ("dro", {"beta": 0.5}), ("gspo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.03})],
)  # fmt: skip
def test_cispo_dro_and_gspo_equal_their_formulas_and_step_as_torch_adamw_on_them(loss_fn, cfg):
    """The loss from the returned log-probabilities, and three steps against torch's AdamW
    on the same formula by autograd (CISPO's clipped ratio and GSPO's sequence mean carry
    no gradient: a wrong detach changes the update, not the loss)."""
    m, seqs = model(), sequences()
    g = torch.Generator().manual_seed(5)
    base = reference_logprobs(m, seqs)
    sampled = [(b + (torch.rand(len(b), generator=g) - 0.5)).tolist() for b in base]
    adv = [torch.randn(len(b), generator=g).tolist() for b in base]
    data = [
        shifted(s, logprobs=q, advantages=a) for s, q, a in zip(seqs, sampled, adv, strict=True)
    ]
    if loss_fn == "gspo":
        for d in data:
            d.inputs["sequence_ratio_mask"] = _marked(len(d.tokens)).float().tolist()
    ref = copy.deepcopy(m)
    opt = torch.optim.AdamW(
        ref.parameters(), lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=0.0,
        foreach=False,
    )  # fmt: skip
    clipped = 0
    with engine_of(m) as engine:
        for _ in range(3):
            out = run(engine, data, loss_fn, cfg)
            engine.step(ADAM)
            got = sum(
                float(
                    _policy_formula(
                        loss_fn, torch.tensor(lp), torch.tensor(q), torch.tensor(a), cfg
                    )
                )
                for lp, q, a in zip(out.logprobs, sampled, adv, strict=True)
            )
            assert out.metrics["loss:sum"] == pytest.approx(got, rel=1e-5)
            total = torch.zeros(())
            for s, q, a in zip(seqs, sampled, adv, strict=True):
                logits = ref(input_ids=torch.tensor([s[:-1]])).logits[0]
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
                total = total + _policy_formula(loss_fn, lp, torch.tensor(q), torch.tensor(a), cfg)
                if loss_fn == "cispo" and cfg:
                    r = torch.exp(lp.detach() - torch.tensor(q))
                    clipped += int((torch.clamp(r, 0.9, 1.1) != r).sum())
                if loss_fn == "gspo":
                    r = torch.exp((lp.detach() - torch.tensor(q))[_marked(len(lp))].mean())
                    clipped += int(not 0.97 <= float(r) <= 1.03)
            total.backward()
            opt.step()
            opt.zero_grad()
        after = run(engine, data, loss_fn, cfg, backward=False)
    for got_lp, w in zip(after.logprobs, reference_logprobs(ref, seqs), strict=True):
        torch.testing.assert_close(torch.tensor(got_lp), w, rtol=1e-4, atol=1e-5)
    if loss_fn in ("cispo", "gspo") and cfg:
        assert clipped > 0  # the clip was exercised


def test_what_cannot_run_is_refused_by_name_before_the_engine_runs():
    seq = sequences(1)[0]
    with engine_of(model()) as engine:
        with pytest.raises(
            Unsupported, match="'custom' is not supported; supported: cross_entropy"
        ):
            run(engine, [shifted(seq, weights=[1.0] * (len(seq) - 1))], "custom")
        with pytest.raises(BadInput, match=r"needs loss_fn_inputs \['advantages'\]"):
            run(engine, [shifted(seq, logprobs=[0.0] * (len(seq) - 1))], "ppo")
        policy = shifted(seq, logprobs=[0.0] * (len(seq) - 1), advantages=[1.0] * (len(seq) - 1))
        with pytest.raises(BadInput, match="dro needs loss_fn_config"):
            run(engine, [policy], "dro")
        with pytest.raises(BadInput, match=r"needs loss_fn_inputs \['sequence_ratio_mask'\]"):
            run(engine, [policy], "gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
        n = len(seq) - 1
        unmasked = shifted(seq, logprobs=[0.0] * n, advantages=[1.0] * n)
        unmasked.inputs["sequence_ratio_mask"] = [0.0] * n
        with pytest.raises(BadInput, match=r"data\[0\]: sequence_ratio_mask marks no token"):
            run(engine, [unmasked], "gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
        with pytest.raises(BadInput, match="must satisfy 0 < low <= 1 <= high"):
            run(engine, [policy], "gspo", {"clip_low_threshold": 1.01})  # above 1 + 4e-4
        with pytest.raises(BadInput, match="must satisfy 0 <= low <= high"):
            run(engine, [policy], "cispo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0})
        for beta in ("x", True, float("nan")):
            with pytest.raises(BadInput, match="must be a number"):
                run(engine, [policy], "dro", {"beta": beta})
        with pytest.raises(BadInput, match="finite and >= 0"):
            run(engine, [policy], "dro", {"beta": float("inf")})
        with pytest.raises(BadInput, match="has 2 entries for"):
            run(engine, [shifted(seq, weights=[1.0, 1.0])], "cross_entropy")
        with pytest.raises(BadInput, match="not used by cross_entropy"):
            run(
                engine,
                [shifted(seq, weights=[1.0] * (len(seq) - 1))],
                "cross_entropy",
                {"clip_low_threshold": 0.5},
            )
        ok = Datum([1, 2], {"target_tokens": [2, 3], "weights": [1.0, 1.0]})
        bad = Datum([1, 99], {"target_tokens": [2, 3], "weights": [1.0, 1.0]})
        with pytest.raises(BadInput, match=r"data\[1\]: a token id outside .* \(0 to 63\)"):
            run(engine, [ok, bad], "cross_entropy")
        # nothing ran: the engine still gives the base's log-probabilities
        out = run(
            engine, [shifted(seq, weights=[1.0] * (len(seq) - 1))], "cross_entropy", backward=False
        )
    torch.testing.assert_close(
        torch.tensor(out.logprobs[0]), reference_logprobs(model(), [seq])[0], rtol=1e-5, atol=1e-5
    )
