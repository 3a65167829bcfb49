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


def kv(n: int, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers' keys and values for `n` tokens (2 heads of 4): 128 bytes a token."""
    return [(torch.full((1, 2, n, 4), fill), torch.full((1, 2, n, 4), fill)) for _ in range(2)]


def test_a_prompt_reuses_the_longest_shared_beginning_but_never_its_last_token():
    c = PrefixCache(1 << 20, min_tokens=4)
    c.store(None, [1, 2, 3, 4, 5, 6], kv(6, 1.0))
    c.store(None, [1, 2, 3, 9, 9, 9, 9], kv(7, 2.0))
    m = c.match(None, [1, 2, 3, 4, 5, 7, 8])
    assert m is not None
    assert m.length == 5
    assert float(m.entry.layers[0][0].max()) == 1.0
    assert m.layers()[1][0].shape == (1, 2, 5, 4)
    same = c.match(None, [1, 2, 3, 4, 5, 6])  # the whole prompt held: its last token is not
    assert same is not None
    assert same.length == 5
    assert c.match(None, [1, 2, 3, 8, 8, 8]) is None  # 3 shared < min_tokens
    assert c.match("lora-a", [1, 2, 3, 4, 5, 7]) is None  # another adapter's keys differ
    assert (c.hits, c.misses, c.reused_tokens) == (2, 2, 10)


def test_entries_are_bounded_in_bytes_least_recently_used_out_and_a_longer_one_replaces():
    c = PrefixCache(128 * 20, min_tokens=2)  # room for 20 tokens
    c.store(None, [1] * 8, kv(8))
    c.store(None, [2] * 8, kv(8))
    assert c.match(None, [1] * 8 + [5]) is not None  # [1]* now the most recently used
    c.store(None, [3] * 8, kv(8))  # 24 tokens: the least recently used ([2]*) goes
    assert c.bytes == 128 * 16
    assert c.match(None, [2] * 9) is None
    assert c.match(None, [1] * 9) is not None
    c.store(None, [3] * 12, kv(12))  # holds [3]*8 whole: replaces it
    assert c.stats()["prefix_entries"] == 2
    assert c.bytes == 128 * 20
    c.store(None, [3] * 6, kv(6))  # already within [3]*12: nothing added
    assert c.holds(None, [3] * 6)
    assert c.bytes == 128 * 20
    c.store(None, [4] * 30, kv(30))  # over the whole budget: not kept
    assert not c.holds(None, [4] * 30)
    c.store("a", [5] * 4, kv(4))  # the least recently used ([1]*) makes room
    assert c.holds("a", [5] * 4)
    assert not c.holds(None, [5] * 4)
    assert not c.holds(None, [1] * 8)
    c.forget("a")
    assert not c.holds("a", [5] * 4)
    assert c.holds(None, [3] * 12)
    assert PrefixCache(0).match(None, [1] * 40) is None  # off


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
    from service.serving.generation import SamplingParams, complete

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
    from service.serving.generation import SamplingParams, complete

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
    from service.serving.generation import SamplingParams, complete

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
    from service.serving.generation import Generator, SamplingParams, complete
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
        assert gen.prefixes.holds("a", ids)
        gen.unload_adapter("a").result(timeout=30)
        assert not gen.prefixes.holds("a", ids)
        assert gen.prefixes.holds(None, ids)
    finally:
        gen.close()
