"""Prompts' keys and values kept across requests (`service.serving.kv.PrefixCache`): which
entry a prompt reuses, the bound in bytes, adapters kept apart; and on a generator, that a
request starting from reused keys and values answers as one prefilled whole (tokens and
log-probabilities against a generator that keeps none), alone, in a group with a request
that reuses nothing, and as the next turn of a conversation whose answer was kept."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from service.serving.kv import PrefixCache

ME = ("acme", None)  # a tenant's prompts on the base model


def kv(n: int, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers' keys and values for `n` tokens (2 heads of 4): 128 bytes a token."""
    return [(torch.full((1, 2, n, 4), fill), torch.full((1, 2, n, 4), fill)) for _ in range(2)]


def test_a_prompt_reuses_the_longest_shared_beginning_but_never_its_last_token():
    c = PrefixCache(1 << 20, min_tokens=4)
    c.store(ME, [1, 2, 3, 4, 5, 6], kv(6, 1.0))
    c.store(ME, [1, 2, 3, 9, 9, 9, 9], kv(7, 2.0))
    m = c.match(ME, [1, 2, 3, 4, 5, 7, 8])
    assert m is not None
    assert m.length == 5
    assert float(m.entry.layers[0][0].max()) == 1.0
    assert m.layers()[1][0].shape == (1, 2, 5, 4)
    same = c.match(ME, [1, 2, 3, 4, 5, 6])  # the whole prompt held: its last token is not
    assert same is not None
    assert same.length == 5
    assert c.match(ME, [1, 2, 3, 8, 8, 8]) is None  # 3 shared < min_tokens
    assert c.match(("acme", "lora-a"), [1, 2, 3, 4, 5, 7]) is None  # another adapter's
    assert c.match(("rival", None), [1, 2, 3, 4, 5, 7]) is None  # another tenant's
    assert (c.hits, c.misses, c.reused_tokens) == (2, 3, 10)


def test_entries_are_bounded_in_bytes_least_recently_used_out_and_a_longer_one_replaces():
    c = PrefixCache(128 * 20, min_tokens=2)  # room for 20 tokens
    c.store(ME, [1] * 8, kv(8))
    c.store(ME, [2] * 8, kv(8))
    assert c.match(ME, [1] * 8 + [5]) is not None  # [1]* now the most recently used
    c.store(ME, [3] * 8, kv(8))  # 24 tokens: the least recently used ([2]*) goes
    assert c.bytes == 128 * 16
    assert c.match(ME, [2] * 9) is None
    assert c.match(ME, [1] * 9) is not None
    c.store(ME, [3] * 12, kv(12))  # holds [3]*8 whole: replaces it
    assert c.stats()["prefix_entries"] == 2
    assert c.bytes == 128 * 20
    c.store(ME, [3] * 6, kv(6))  # already within [3]*12: nothing added
    assert c.holds(ME, [3] * 6)
    assert c.bytes == 128 * 20
    c.store(ME, [4] * 30, kv(30))  # over the whole budget: not kept
    assert not c.holds(ME, [4] * 30)
    c.store(("acme", "a"), [5] * 4, kv(4))  # the least recently used ([1]*) makes room
    assert c.holds(("acme", "a"), [5] * 4)
    assert not c.holds(ME, [5] * 4)
    assert not c.holds(ME, [1] * 8)
    c.forget("a")
    assert not c.holds(("acme", "a"), [5] * 4)
    assert c.holds(ME, [3] * 12)
    assert PrefixCache(0).match(ME, [1] * 40) is None  # off


@pytest.fixture(scope="module")
def gens(tmp_path_factory):
    """The tiny Llama twice: keeping prompts (16 tokens reused at least) and keeping none."""
    from service.serving.generation import Generator
    from tests.tiny import make_tiny_llama

    base = make_tiny_llama(tmp_path_factory.mktemp("prefix") / "base")
    kept, plain = Generator(base, prefix_min_tokens=16), Generator(base, prefix_cache_bytes=0)
    yield kept, plain
    kept.close()
    plain.close()


SYSTEM = "You answer in one word. " * 4


def prompt(gen, word: str) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{word}?"}]
    return gen.render(msgs)


def assert_same(got, want) -> None:
    assert got.tokens == want.tokens
    for i in want.logprobs:
        assert got.logprobs[i] == pytest.approx(want.logprobs[i], abs=1e-4)


def test_a_shared_system_prompt_is_prefilled_once_and_answers_as_prefilled_whole(gens):
    from service.serving.collect import complete
    from service.serving.generation import SamplingParams

    kept, plain = gens
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=True, n=2)
    first, second = prompt(kept, "apple"), prompt(kept, "thunder")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 16
    a = complete(kept, first, greedy)
    assert a.usage is not None
    assert a.usage.cached_tokens == 0
    b = complete(kept, second, greedy)
    assert b.usage is not None
    assert b.usage.cached_tokens == shared
    assert_same(a, complete(plain, first, greedy))
    assert_same(b, complete(plain, second, greedy))
    again = complete(kept, first, greedy)  # the whole prompt held: all but its last token
    assert again.usage is not None
    assert again.usage.cached_tokens == len(first) - 1
    assert_same(again, a)


def test_the_next_turn_reuses_the_kept_answer_too(gens):
    """One choice's prompt and answer are kept as it ends: a follow-up that sends them
    back reuses all but the answer's last token (the one never fed)."""
    from service.serving.collect import complete
    from service.serving.generation import SamplingParams

    kept, plain = gens
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    first = prompt(kept, "meadow")
    answer = complete(kept, first, greedy).tokens[0]
    assert len(answer) == 6
    follow = first + list(answer) + kept.encode(" and harbor?")
    got = complete(kept, follow, greedy)
    assert got.usage is not None
    assert got.usage.cached_tokens == len(first) + len(answer) - 1
    assert_same(got, complete(plain, follow, greedy))


def test_a_group_mixing_reused_and_fresh_prompts_answers_each_as_alone(gens):
    """Queued together: a prompt with kept keys and values (padding between its two
    parts) and one with none, in one prefill; each answers as on the generator that keeps
    nothing, and the fresh one's prompt log-probabilities are its whole prompt's."""
    from service.serving.collect import complete
    from service.serving.generation import SamplingParams

    kept, plain = gens
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=True)
    scored = SamplingParams(max_tokens=6, temperature=0, logprobs=True, prompt_logprobs=True)
    complete(kept, prompt(kept, "river"), greedy)
    asks = [
        (prompt(kept, "river stone"), greedy),
        (kept.encode("What does light mean?"), greedy),
        (prompt(kept, "river cloud"), scored),  # asks for every prompt position: whole
    ]
    before = kept.prefills
    busy = threading.Event()
    kept.call(lambda: (busy.set(), time.sleep(0.5)))
    busy.wait(10)
    got: list = [None] * len(asks)

    def ask(i: int) -> None:
        got[i] = complete(kept, *asks[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kept.prefills == before + 1
    assert [g.usage.cached_tokens > 0 for g in got] == [True, False, False]
    for g, (ids, params) in zip(got, asks, strict=True):
        want = complete(plain, ids, params)
        assert_same(g, want)
        if params.prompt_logprobs:
            assert g.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)


def test_an_adapters_prompts_are_its_own_and_go_with_it(tmp_path):
    from benchmarks.models_made import _adapter
    from service.serving.collect import complete
    from service.serving.generation import Generator, SamplingParams
    from tests.tiny import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    _adapter(base, tmp_path / "a", seed=1)
    gen = Generator(base, prefix_min_tokens=8)
    try:
        ids = prompt(gen, "apple")
        greedy = SamplingParams(max_tokens=4, temperature=0)
        complete(gen, ids, greedy)
        tuned = complete(gen, ids, greedy, "a", tmp_path / "a")
        assert tuned.usage is not None
        assert tuned.usage.cached_tokens == 0
        assert gen.prefixes.holds((None, "a"), ids)
        gen.unload_adapter("a").result(timeout=30)
        assert not gen.prefixes.holds((None, "a"), ids)
        assert gen.prefixes.holds((None, None), ids)
    finally:
        gen.close()


def test_a_tenants_kept_prompts_are_not_reused_for_another_tenant(gens):
    """The same system prompt from a second tenant reuses nothing of the first's (its
    cached_tokens would tell how another tenant's prompts begin), then its own."""
    from service.serving.collect import complete
    from service.serving.generation import SamplingParams

    kept, _ = gens
    greedy = SamplingParams(max_tokens=2, temperature=0)
    complete(kept, prompt(kept, "window"), greedy, tenant="acme")
    other = complete(kept, prompt(kept, "candle"), greedy, tenant="rival")
    assert other.usage is not None
    assert other.usage.cached_tokens == 0
    mine = complete(kept, prompt(kept, "candle"), greedy, tenant="acme")
    assert mine.usage is not None
    assert mine.usage.cached_tokens > 16
    again = complete(kept, prompt(kept, "lantern"), greedy, tenant="rival")
    assert again.usage is not None
    assert again.usage.cached_tokens > 16


def test_a_sliding_window_model_keeps_nothing_and_answers_past_its_window(tmp_path):
    """A cache layer that keeps only its window (a sliding-window Mistral) cannot give a
    prompt's columns back: nothing is kept, and a prompt longer than the window answers
    as transformers' greedy generate does (the prefill once failed copying them out)."""
    import torch
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    from service.serving.collect import complete
    from service.serving.generation import Generator, SamplingParams
    from tests.tiny import make_tiny_llama

    llama = make_tiny_llama(tmp_path / "llama")
    tok = AutoTokenizer.from_pretrained(llama)
    cfg = MistralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        max_position_embeddings=256, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path / "mistral"
    MistralForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    gen = Generator(out, prefix_min_tokens=4)
    try:
        assert not gen.prefixes.enabled
        ids = prompt(gen, "apple")
        assert len(ids) > 8
        got = complete(gen, ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert got.error is None
        model = MistralForCausalLM.from_pretrained(out).eval()
        want = model.generate(
            torch.tensor([ids]), max_new_tokens=4, do_sample=False, min_new_tokens=4
        )[0, len(ids) :].tolist()
        assert list(got.tokens[0]) == want
        assert gen.prefixes.stats()["prefix_entries"] == 0
    finally:
        gen.close()


def test_only_the_last_n_prompt_logprobs_asked_reuse_the_context_before_them(gens):
    """Tinker's compute_logprobs(prompt, prompt_logprobs_last_n=n): log P(completion |
    context) for several completions of one long context. The context's keys and values
    come from the cache; the last n values equal a whole prefill's, the others are NaN;
    asking for every position reuses nothing."""
    import math

    from service.serving.collect import complete
    from service.serving.generation import SamplingParams

    kept, plain = gens
    context = prompt(kept, "ocean")
    ends = [kept.encode(" blue and deep"), kept.encode(" cold at night, mostly")]
    for end in ends:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True,
                                prompt_logprobs_last_n=len(end))  # fmt: skip
        got = complete(kept, context + end, params)
        whole = complete(plain, context + end, SamplingParams(max_tokens=1, prompt_logprobs=True))
        assert got.usage is not None
        n = len(end)
        assert got.prompt_logprobs is not None
        assert whole.prompt_logprobs is not None
        assert len(got.prompt_logprobs) == len(context) + n
        assert got.prompt_logprobs[-n:] == pytest.approx(whole.prompt_logprobs[-n:], abs=1e-4)
        if end is ends[1]:  # the first stored the context (and its own end); the
            # context's last token is fed again, for the first asked token's logits
            assert got.usage.cached_tokens == len(context) - 1
            assert all(math.isnan(v) for v in got.prompt_logprobs[: len(context)])
    every = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True)
    got = complete(kept, context + ends[0], every)
    assert got.usage is not None
    assert got.usage.cached_tokens == 0
    assert not any(math.isnan(v) for v in got.prompt_logprobs[1:])
