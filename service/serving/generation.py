"""Text generation for served models: one model in memory, many requests decoded together,
LoRA adapters applied per row.

`Generator` owns a transformers model (the base, or a full fine-tune) and a thread that
runs the decode loop. Requests join the running batch between steps (continuous
batching): each is prefilled alone (so a lone request computes exactly what `generate`
computes), its KV cache left-padded to the batch's length and stacked under it; a
finished row leaves at once, and cache columns that no row needs any more are cut.
Rows of one batch can use different adapters: peft's mixed-adapter forward
(`adapter_names`) applies each row's LoRA to its row only, and `"__base__"` rows see the
base weights untouched.

Requests waiting together are prefilled together: one forward over their prompts, left-
padded to the longest (a lone request is exactly `generate`'s prefill), so the time to a
first token does not grow with every request queued before it. A request's `n` choices
share its prompt's KV cache (its rows are copies of the one prefilled row).

Greedy decoding (temperature 0) is the argmax of fp32 logits, as `generate` takes it; with
a temperature, each choice samples from its own `torch.Generator`, seeded by the request's
`seed` and the choice's index, so a seeded request repeats; `top_k`, then `top_p`, narrow
the choice. A sampled token's log-probability (`logprobs`) is under the distribution it was
drawn from before that narrowing: softmax(logits / temperature), or the model's own
softmax when greedy.

What the thread emits to a request, through its `emit` callback (called on the thread;
the caller hops to its own loop): `Token(index, text)` pieces of text as they become
final (held back while they could still be the start of a stop string, or end in the
middle of a UTF-8 character), `Finish(index, reason)` per choice, then `Done(usage)`.

Beside it: the batch's KV caches and the prompts kept across requests (`kv`), constrained
decoding (`guided`), a choice's released text (`text`), and a blocking run of one request
(`collect.complete`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.data.tokens import eos_ids
from service.data.tools import ToolFormatError, reads_calls, template_messages
from service.serving.guided import Guide
from service.serving.kv import (
    PrefixCache,
    cut_common_padding,
    reused_cache,
    row_layers,
    stack_under,
)
from service.serving.text import TextStream

log = logging.getLogger(__name__)

BASE = "__base__"  # peft's name for "no adapter" in a mixed-adapter batch


def peft_name(key: str) -> str:
    """The adapter's name inside peft (a module name: no dots or slashes, unlike a key)."""
    import hashlib

    return "a" + hashlib.sha1(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0: no limit
    stop_tokens: tuple[int, ...] = ()  # ids that end a choice (kept as its last token)
    ignore_eos: bool = False  # the end-of-turn tokens do not end a choice
    logprobs: bool = False  # each sampled token's log-probability, in its Finish
    prompt_logprobs: bool = False  # each prompt token's, in a PromptLogprobs event first
    # with either: the k likeliest tokens at each position too, under the model's own
    # distribution (no temperature), as (token id, log-probability) pairs
    top_logprobs: int = 0
    grammar: str | None = None  # each choice decoded to it (llguidance's; see grammar_of)
    # with prompt_logprobs: only the last n are wanted, so the tokens before them may come
    # from the prefix cache (the others are NaN, as the first always is)
    prompt_logprobs_last_n: int | None = None


@dataclass(frozen=True)
class Token:
    index: int
    text: str


@dataclass(frozen=True)
class Finish:
    index: int
    reason: str  # stop | length
    tokens: tuple[int, ...] = ()  # every token the choice generated (an end-of-turn one too)
    logprobs: tuple[float, ...] = ()  # theirs, when the request asked (`logprobs`)
    top: tuple[tuple[tuple[int, float], ...], ...] = ()  # each token's `top_logprobs`


@dataclass(frozen=True)
class PromptLogprobs:
    """Each prompt token's log-probability given the tokens before it (the first has none:
    NaN), sent before any token when the request asked (`prompt_logprobs`), and with
    `top_logprobs` the likeliest tokens at each position (the first has none: ())."""

    values: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class Done:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Any], None]
    adapter: str | None = None  # the adapter's key (its directory relative to the data dir)
    adapter_path: Path | None = None  # where it is, to load it if it is not in memory
    tenant: str | None = None  # whose request: prompts are kept for their tenant only
    cancelled: bool = False
    completion_tokens: int = 0
    open_choices: int = 0
    cached_tokens: int = 0

    @property
    def owner(self) -> tuple[str | None, str | None]:
        """Whose kept prompts this request may reuse (service.serving.kv)."""
        return (self.tenant, self.adapter)


@dataclass
class _Row:
    """One choice of one request in the running batch."""

    req: Request
    index: int
    text: TextStream
    rng: torch.Generator | None
    generated: int = 0
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    matcher: Any = None  # the row's JSON-schema matcher (llguidance) when it has a schema


class Generator:
    """One model and the thread that decodes every request sent to it."""

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_batch: int = 32,
        max_adapters: int = 8,
        prefix_cache_bytes: int = 512 << 20,
        prefix_min_tokens: int = 16,
    ) -> None:
        from transformers import AutoTokenizer, DynamicCache
        from transformers.cache_utils import DynamicLayer

        from pstar_core.hf import load_causal_lm
        from service.data.datasets import ensure_chat_template

        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        ensure_chat_template(self.tokenizer)
        self.model = load_causal_lm(self.model_dir, dtype=dtype)
        self.model.to(self.device).eval()
        self.peft: Any = None  # the model wrapped by peft once an adapter is loaded
        # loaded adapter key -> its directory, least recently used first
        self.adapters: OrderedDict[str, Path] = OrderedDict()
        self.max_adapters = max_adapters
        self._unload: set[str] = set()  # adapters to drop once no row uses them
        self.eos = eos_ids(self.model, self.tokenizer)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.guide = Guide(self.tokenizer, self.vocab_size)  # constrained decoding
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.max_batch = max_batch
        # prompts' keys and values across requests: for caches of plain layers only (a
        # sliding window's layer keeps its own count of what it has seen)
        plain = all(type(x) is DynamicLayer for x in DynamicCache(config=self.model.config).layers)
        self.prefixes = PrefixCache(prefix_cache_bytes if plain else 0, prefix_min_tokens)
        self._mergeable = True  # KV caches of requests can be stacked (DynamicLayer only)
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._calls: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [rows, cache length], 0 on left padding
        self._last: torch.Tensor | None = None  # [rows] the token each row feeds next
        self._pos: torch.Tensor | None = None  # [rows] that token's position
        self._stopping = False
        self.busy_s = 0.0
        self.steps = 0
        self.prefills = 0  # forwards over prompts (several requests' at once when queued)
        self._thread = threading.Thread(target=self._run, name="generator", daemon=True)
        self._thread.start()

    # -- what callers use ------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """A chat's prompt tokens, by the model's chat template (ChatML when it has none),
        with the assistant's turn opened, as training renders the turns before an answer:
        tools, calls and tool results as training renders them (service/data/tools.py)."""
        if tools and not reads_calls(self.tokenizer):
            raise ToolFormatError(
                "this model's chat template writes tool calls in a format this service "
                "does not read back (it reads <tool_call> blocks); call it without tools"
            )
        turns, native = template_messages(self.tokenizer, messages, tools, lambda c: c)
        text = self.tokenizer.apply_chat_template(
            turns, tools=native, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def submit(self, req: Request) -> None:
        self._inbox.put(req)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the decode thread between two steps (model changes happen there)."""
        fut: Future = Future()
        self._calls.put((fn, fut))
        return fut

    def unload_adapter(self, key: str) -> Future:
        return self.call(lambda: self._drop_adapter(key))

    def stats(self) -> dict[str, Any]:
        return {
            "rows": len(self._rows),
            "queued": self._inbox.qsize(),
            "adapters": sorted(self.adapters),
            "steps": self.steps,
            "prefills": self.prefills,
            "busy_s": round(self.busy_s, 3),
            **self.prefixes.stats(),
        }

    def close(self) -> None:
        self._stopping = True
        self._inbox.put(None)  # type: ignore[arg-type]
        self._thread.join(timeout=10)

    # -- adapters ----------------------------------------------------------------------------

    def _load_adapter(self, key: str, path: Path, keep: frozenset[str] = frozenset()) -> None:
        """Load an adapter (the decode thread, between steps), the least recently used
        one that no row decodes with out first when `max_adapters` are in memory."""
        self._unload.discard(key)
        if key in self.adapters:
            self.adapters.move_to_end(key)
            return
        from peft import PeftModel

        from pstar_core.hf import HF_LOADS

        busy = {r.req.adapter for r in self._rows} | keep  # `keep`: the group being admitted
        for old in [k for k in self.adapters if k not in busy]:
            if len(self.adapters) < self.max_adapters:
                break
            self._drop_adapter(old)

        name = peft_name(key)
        with HF_LOADS:  # [Note: one transformers load at a time]
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
                self.peft.eval()
            else:
                self.peft.load_adapter(path, adapter_name=name)
        self.adapters[key] = path
        log.info("adapter %s loaded from %s", key, path)

    def _drop_adapter(self, key: str) -> None:
        if key not in self.adapters:
            return
        if any(r.req.adapter == key for r in self._rows):
            self._unload.add(key)  # rows still decode with it: dropped when they end
            return
        if len(self.adapters) == 1:
            # the last one: back to the plain model (peft would keep the deleted adapter
            # active, and every forward after raised a KeyError)
            self.model = self.peft.unload()
            self.peft = None
        else:
            self.peft.delete_adapter(peft_name(key))
        del self.adapters[key]
        self.prefixes.forget(key)
        log.info("adapter %s unloaded", key)

    # -- the decode thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._run_calls()
            self._admit(block=not self._rows)
            if self._stopping:
                break
            if self._rows:
                t0 = time.perf_counter()
                try:
                    self._step()
                except Exception as e:  # a bug or an OOM: fail the rows, keep serving
                    log.exception("decode step failed")
                    self._fail_all(f"generation failed: {e}")
                self.busy_s += time.perf_counter() - t0
        self._fail_all("the model server is shutting down")

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

    def _admit(self, block: bool) -> None:
        """Prefill the requests waiting, as many as the batch has room for, together."""
        group: list[Request] = []
        room = self.max_batch - len(self._rows)
        while room > 0 and (self._mergeable or not self._rows):
            try:
                req = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block and not group and self._calls.empty() and not self._stopping:
                    continue
                break
            if req is None:
                break
            block = False
            if req.cancelled:
                continue
            if req.adapter is not None:
                try:
                    keep = frozenset(r.adapter for r in group if r.adapter is not None)
                    self._load_adapter(req.adapter, req.adapter_path or Path(req.adapter), keep)
                except Exception as e:  # its files are gone or not an adapter
                    log.warning("adapter %s could not load: %s", req.adapter, e)
                    req.emit(LookupError(f"adapter {req.adapter} could not load: {e}"))
                    continue
            group.append(req)
            room -= req.params.n
        if group:
            self._timed_prefill(group)

    def _timed_prefill(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        try:
            self._prefill(reqs)
        except Exception as e:
            log.exception("prefill failed")
            for req in reqs:
                req.emit(RuntimeError(f"generation failed: {e}"))
        self.busy_s += time.perf_counter() - t0
        self.prefills += 1

    def _forward(self, ids, mask, pos, cache, adapters: list[str | None], every: bool = False):
        """The last position's fp32 logits ([rows, vocab]; with `every`, every position's:
        [rows, length, vocab]) and the cache."""
        kw: dict[str, Any] = {}
        model = self.model
        if self.peft is not None:
            model = self.peft
            kw["adapter_names"] = [peft_name(a) if a else BASE for a in adapters]
        with torch.inference_mode():
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                cache=cache,
                use_cache=True,
                logits_to_keep=0 if every else 1,
                **kw,
            )
        if every:
            return out.logits.float(), out.cache
        return out.logits[:, -1, :].float(), out.cache

    def _prefill(self, reqs: list[Request]) -> None:
        """One forward over the prompts of `reqs`, then each request's `n` rows from its one
        prefilled row, joined to the batch.

        A prompt that begins with tokens the prefix cache holds starts from their keys and
        values and is prefilled over the rest (`service.serving.kv`); a request asking for
        its prompt's log-probabilities is prefilled whole. Rows are left-padded twice: the
        reused columns to the longest reused, the new tokens to the longest rest, so a
        row's padding may sit between its two parts (its mask and positions say which
        columns are its own). A lone request with nothing reused is `generate`'s prefill."""
        from transformers import DynamicCache

        found = [self.prefixes.match(r.owner, self._reusable(r)) for r in reqs]
        used = [m.length if m is not None else 0 for m in found]
        reused = max(used)
        width = max(len(r.prompt_ids) - u for r, u in zip(reqs, used, strict=True))
        ids = torch.zeros((len(reqs), width), dtype=torch.long)
        mask = torch.zeros((len(reqs), reused + width), dtype=torch.long)
        for k, (r, u) in enumerate(zip(reqs, used, strict=True)):
            rest = r.prompt_ids[u:]
            ids[k, width - len(rest) :] = torch.tensor(rest)
            mask[k, reused - u : reused] = 1
            mask[k, reused + width - len(rest) :] = 1
            r.cached_tokens = u
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)[:, reused:]
        every = any(r.params.prompt_logprobs for r in reqs)
        cache = DynamicCache(config=self.model.config)
        if reused:
            reused_cache(cache, found, reused)
        logits, cache = self._forward(ids, mask, pos, cache, [r.adapter for r in reqs], every)
        for k, r in enumerate(reqs):
            if self.prefixes.wants(r.owner, r.prompt_ids):
                self.prefixes.store(r.owner, r.prompt_ids, row_layers(cache, k, mask))
        if every:
            for k, req in enumerate(reqs):
                if req.params.prompt_logprobs:  # its own positions, past what was reused
                    at = width - (len(req.prompt_ids) - used[k])
                    every_lp = torch.log_softmax(logits[k, at:-1], -1)
                    lp = every_lp.gather(-1, ids[k, at + 1 :, None])[:, 0]
                    top = likeliest(every_lp, req.params.top_logprobs)
                    unknown = used[k] + 1  # the first token, and those reused
                    values = (float("nan"),) * unknown + tuple(lp.tolist())
                    req.emit(PromptLogprobs(values, ((),) * unknown + tuple(top) if top else ()))
            logits = logits[:, -1]
        rows: list[_Row] = []
        of: list[int] = []  # the prefilled row each new row copies
        for k, req in enumerate(reqs):
            p = req.params
            for i in range(p.n):
                rng = None
                if p.temperature > 0:
                    rng = torch.Generator(device="cpu")
                    if p.seed is not None:
                        rng.manual_seed((p.seed * 1000003 + i) % (1 << 63))  # any int
                    else:
                        rng.seed()
                row = _Row(req, i, TextStream(self.tokenizer, p.stop), rng)
                if p.grammar is not None:
                    row.matcher = self.guide.matcher(p.grammar)
                rows.append(row)
                of.append(k)
            req.open_choices = p.n
        if of != list(range(len(reqs))):  # choices share their prompt's cache row
            cache.batch_select_indices(torch.tensor(of, device=self.device))
        first = self._choose(logits[of], rows)
        lengths = torch.tensor([len(reqs[k].prompt_ids) for k in of], device=self.device)
        self._join(rows, cache, mask[of], first, lengths)
        self._emit_tokens(rows, first.tolist())

    @staticmethod
    def _reusable(req: Request) -> list[int]:
        """The tokens of `req`'s prompt whose keys and values may come from the prefix
        cache (all but the last, `PrefixCache.match`'s rule): none for a request asking for
        every prompt token's log-probability, those before the last n it asks for."""
        p, ids = req.params, req.prompt_ids
        if not p.prompt_logprobs:
            return ids
        if p.prompt_logprobs_last_n is None:
            return []
        return ids[: max(0, len(ids) - p.prompt_logprobs_last_n)]

    def _choose(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Each row's next token from its fp32 logits ([rows, vocab]), in one batched pass:
        greedy rows take the argmax; the others draw from softmax(logits / temperature),
        narrowed by their `top_k` and `top_p`, by the inverse of the cumulative
        distribution at a uniform number from the row's own generator (one number per
        token: a seeded choice repeats, and it costs a cumulative sum, where
        `torch.multinomial` with a generator took 1.3 ms a row). A sampled token's
        log-probability is kept for rows that asked."""
        params = [r.req.params for r in rows]
        guided = [i for i, r in enumerate(rows) if r.matcher is not None]
        if guided:
            self.guide.constrain(logits, [rows[i].matcher for i in guided], guided)
        toks = logits.argmax(-1)
        draw = [i for i, p in enumerate(params) if p.temperature > 0]
        want = [i for i, p in enumerate(params) if p.logprobs]
        if not draw and not want:  # all greedy, no log-probabilities asked: the argmax
            self.guide.consume([rows[i].matcher for i in guided], [int(toks[i]) for i in guided])
            return toks
        temps = torch.tensor(
            [p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device
        )
        lp = torch.log_softmax(logits / temps[:, None], -1)
        if draw:
            probs = lp[draw].exp()
            for j, i in enumerate(draw):
                probs[j] = narrowed(probs[j], params[i].top_k, params[i].top_p)
            # a temperature so small the division overflows: greedy
            finite = torch.isfinite(probs).all(-1)
            probs = torch.where(finite[:, None], probs, torch.zeros_like(probs))
            cdf = probs.double().cumsum(-1)
            u = torch.tensor(
                [1.0 - float(torch.rand((), generator=rows[i].rng)) for i in draw],
                dtype=torch.float64,
                device=logits.device,
            )  # in (0, 1]: never the first token of a zero-probability run
            picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0]
            picked = picked.clamp(max=logits.shape[-1] - 1)
            at = torch.tensor(draw, device=logits.device)
            toks[at] = torch.where(finite, picked, toks[at])
        if want:
            at = torch.tensor(want, device=logits.device)
            got = lp[at, toks[at]]
            raw = torch.log_softmax(logits[at], -1).gather(-1, toks[at][:, None])[:, 0]
            got = torch.where(torch.isfinite(got), got, raw)  # an overflowed temperature's
            for i, v in zip(want, got.tolist(), strict=True):
                rows[i].logprobs.append(v)
            k = max(params[i].top_logprobs for i in want)
            if k:
                tops = likeliest(torch.log_softmax(logits[at], -1), k)
                for i, top in zip(want, tops, strict=True):
                    rows[i].top.append(top[: params[i].top_logprobs])
        self.guide.consume([rows[i].matcher for i in guided], [int(toks[i]) for i in guided])
        return toks

    def _join(self, rows, cache, mask, last, pos) -> None:
        """Stack new rows (their cache, mask, next token, position) under the batch."""
        layers = getattr(cache, "layers", None)
        from transformers.cache_utils import DynamicLayer

        self._mergeable = bool(layers) and all(type(x) is DynamicLayer for x in layers)
        if not self._rows:
            self._rows, self._cache, self._last, self._pos = rows, cache, last, pos
            self._mask = mask.clone()
            return
        self._mask = stack_under(self._cache, self._mask, cache, mask)
        self._rows = self._rows + rows
        self._last = torch.cat([self._last, last])
        self._pos = torch.cat([self._pos, pos])

    def _step(self) -> None:
        live = [i for i, r in enumerate(self._rows) if not r.req.cancelled]
        if len(live) < len(self._rows):
            self._keep(live)
            if not self._rows:
                return
        ones = torch.ones((len(self._rows), 1), dtype=self._mask.dtype, device=self.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        logits, self._cache = self._forward(
            self._last[:, None],
            self._mask,
            self._pos[:, None],
            self._cache,
            [r.req.adapter for r in self._rows],
        )
        self.steps += 1
        nxt = self._choose(logits, self._rows)
        self._last = nxt
        self._pos = self._pos + 1
        self._emit_tokens(self._rows, nxt.tolist())

    def _emit_tokens(self, rows: list[_Row], tokens: list[int]) -> None:
        keep = []
        for i, (row, tok) in enumerate(zip(rows, tokens, strict=True)):
            req, p = row.req, row.req.params
            row.generated += 1
            req.completion_tokens += 1
            reason = None
            if (tok in self.eos and not p.ignore_eos) or tok in p.stop_tokens:
                reason = "stop"
                text = row.text.rest()
                row.text.ids.append(tok)
            else:
                text, stopped = row.text.add(tok)
                if stopped:
                    reason = "stop"
                elif row.generated >= p.max_tokens or self._full(row):
                    reason = "length"
                    text += row.text.rest()
            if text:
                req.emit(Token(row.index, text))
            if reason is None:
                keep.append(i)
                continue
            req.emit(
                Finish(row.index, reason, tuple(row.text.ids), tuple(row.logprobs), tuple(row.top))
            )
            if rows is self._rows and p.n == 1:
                self._keep_prefix(i, row)
            req.open_choices -= 1
            if req.open_choices == 0:
                req.emit(Done(len(req.prompt_ids), req.completion_tokens, req.cached_tokens))
        if rows is self._rows:
            if len(keep) < len(rows):
                self._keep(keep)
        elif len(keep) < len(rows):  # rows just admitted, now the batch's last ones
            start = len(self._rows) - len(rows)
            self._keep(list(range(start)) + [start + k for k in keep])

    def _keep_prefix(self, i: int, row: _Row) -> None:
        """Keep the keys and values of batch row `i`, ending now: its prompt and all but
        its last token (never fed), where the next turn of its conversation starts."""
        if not self.prefixes.enabled or self._mask is None:
            return
        ids = row.req.prompt_ids + row.text.ids[: row.generated - 1]
        if not self.prefixes.wants(row.req.owner, ids) or int(self._mask[i].sum()) != len(ids):
            return
        self.prefixes.store(row.req.owner, ids, row_layers(self._cache, i, self._mask))

    def _full(self, row: _Row) -> bool:
        return len(row.req.prompt_ids) + row.generated >= self.context

    def _keep(self, idx: list[int]) -> None:
        """Keep only the rows at `idx`; cut cache columns that every kept row pads."""
        if not idx:
            self._clear()
        else:
            at = torch.tensor(idx, device=self.device)
            self._cache.batch_select_indices(at)
            self._rows = [self._rows[i] for i in idx]
            self._mask, self._last, self._pos = self._mask[at], self._last[at], self._pos[at]
            self._mask = cut_common_padding(self._cache, self._mask)
        for key in list(self._unload):
            if not any(r.req.adapter == key for r in self._rows):
                self._unload.discard(key)
                self._drop_adapter(key)

    def _clear(self) -> None:
        self._rows, self._cache, self._mask, self._last, self._pos = [], None, None, None, None

    def _fail_all(self, message: str) -> None:
        seen = set()
        for r in self._rows:
            if id(r.req) not in seen:
                seen.add(id(r.req))
                r.req.emit(RuntimeError(message))
        self._clear()


def likeliest(logprobs: torch.Tensor, k: int) -> list[tuple[tuple[int, float], ...]]:
    """Each row's `k` likeliest tokens and their log-probabilities ([rows, vocab] in)."""
    if k <= 0:
        return []
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), -1)
    return [
        tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
    ]


def narrowed(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """A row's probabilities kept to its `top_k` likeliest tokens, then to the smallest set
    reaching `top_p` (always the likeliest token: a top_p of 5e-324 is 0 in float32)."""
    if 0 < top_k < probs.numel():
        top, at = probs.topk(top_k)
        probs = torch.zeros_like(probs).scatter(0, at, top / top.sum())
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return probs


def default_dtype(device: str) -> torch.dtype:
    """fp32 on a CPU (bf16 matmuls are ~30x slower without AVX-512 BF16, and exactness
    against `generate` is asked in fp32), bf16 on a GPU that has it."""
    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32
