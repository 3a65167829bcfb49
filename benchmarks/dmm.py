"""Dynamic memory management (DMM) benchmarks: eviction traffic and the largest trainable model.

This module owns two measured claims about the engine's memory tiers:

- `run_eviction`: bytes moved between host and device per steady-state iteration under the
  eviction policies opt / lru / static, at device budgets swept from tight to "all model
  data fits" (measured peak non-model memory + a fraction of the chunk bytes of all four
  lists), next to lower bounds on the fetches;
- `benchmarks.scale.run_scale` (its own module): the largest GPT each system trains.

Each prints a rich table and, with ``json_out``, one JSON line last.

    python -c "from benchmarks.dmm import run_eviction; run_eviction(json_out=True)"
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import pstar_core
from benchmarks.report import bench_dtype, finish, load_avg, machine, median
from pstar_core.mapping import pack
from pstar_core.models import GPT, build, get_config, num_params
from pstar_core.tiers import MemoryBudgetError

__all__ = ["choose_chunk_size", "run_eviction"]

POLICIES = ("opt", "lru", "static")
# device budget = peak non-model N + fraction x model data M (the chunks of all four lists)
BUDGET_FRACTIONS = (0.15, 0.3, 0.5, 0.75, 1.0)
MIB = 2**20
GIB = 2**30


def _console() -> Console:
    return Console(width=max(Console().width, 150))


# -- chunk size ---------------------------------------------------------------------------


def _param_numels(model_fn: Callable[[], torch.nn.Module]) -> list[int]:
    """Parameter sizes in registration order (= chunk packing order), tied weights once."""
    with torch.device("meta"):
        module = model_fn()
    return [p.numel() for p in module.parameters()]


def choose_chunk_size(numels: list[int], lo: int = 12, hi: int = 20, target: int = 16) -> int:
    """A chunk size (elements, multiple of 1024) giving `lo`..`hi` param chunks if possible.

    Eviction only has choices when there are many chunks; among sizes in range the one with
    the least padding wins, ties going to the count nearest `target`. Falls back to the
    largest tensor's size (the fewest elements a chunk may hold) when no size lands in range.
    """
    biggest, total = max(numels), sum(numels)
    floor_size = max(1024, -(-biggest // 1024) * 1024)
    best: tuple[float, int, int] | None = None
    for k in range(hi, lo - 1, -1):
        for slack in (1.0, 1.05, 1.1, 1.2, 1.3):
            size = max(floor_size, -(-int(total * slack / k) // 1024) * 1024)
            n = pack(numels, size).num_chunks
            if lo <= n <= hi:
                waste = n * size - total
                key = (waste / total, abs(n - target), size)
                if best is None or key < best:
                    best = key
    return best[2] if best is not None else floor_size


# -- one engine run -----------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """What one engine run measured; `cum[i]` is cumulative bytes moved after iteration i+1."""

    stats: dict[str, Any]
    cum: list[dict[str, int]]
    seconds: list[float]
    losses: list[float]
    # Max over steady iterations of the chunk bytes on the device during each moment.
    resident: dict[int, int]
    param_uses: dict[int, list[int]]  # param chunk index -> traced fwd/bwd moments


def _run_engine(
    model_fn: Callable[[], torch.nn.Module],
    config: dict[str, Any],
    batches: list[torch.Tensor],
) -> _Run:
    """Initialize and train one iteration per batch; may raise MemoryBudgetError."""
    gc.collect()  # the previous run's chunks go back before this one allocates its own
    torch.manual_seed(0)  # same init in every run, so final losses must agree too
    engine = pstar_core.initialize(model_fn, config)
    m = engine.manager
    resident: dict[int, int] = {}
    steady = False
    orig_begin = m.begin_operator

    # Observation only: the engine evicts when an operator needs a fetch, so the chunk bytes on
    # the device while moment j runs are what is resident when moment j+1 begins. Recording
    # them shows whether chunks + traced non-model memory stay within the device budget.
    def begin_operator(name: str) -> None:
        if steady and m.tracer.moment >= 0:
            j = m.tracer.moment
            resident[j] = max(resident.get(j, 0), m.residency.tiers["device"].used_bytes)
        orig_begin(name)

    m.begin_operator = begin_operator  # type: ignore[method-assign]
    cum: list[dict[str, int]] = []
    seconds: list[float] = []
    losses: list[float] = []
    try:
        for i, x in enumerate(batches):
            steady = i >= 2  # iteration 1 traces, iteration 2 places the optimizer states
            t0 = time.perf_counter()
            out = engine(input_ids=x, labels=x)
            engine.backward(out.loss)
            engine.step()
            seconds.append(time.perf_counter() - t0)
            losses.append(float(out.loss.detach()))
            if steady:
                j = m.tracer.moment
                resident[j] = max(resident.get(j, 0), m.residency.tiers["device"].used_bytes)
            cum.append(dict(m.residency.transfers.bytes_moved))
        stats = engine.stats()
        trace = m.tracer.trace
        names = trace.names if trace is not None else []
        uses: dict[int, list[int]] = {}
        if trace is not None:
            for (kind, index), moments in trace.uses.items():
                if kind == "param":
                    uses[index] = [t for t in moments if not names[t].startswith("adam")]
    finally:
        # Dropping the wrapper breaks the manager <-> closure cycle, so the engine's memory
        # is freed by reference counting when this function returns.
        del m.begin_operator
        m.close()
    return _Run(stats, cum, seconds, losses, resident, uses)


def _per_iter(run: _Run, key: str | None) -> float:
    """Bytes moved per steady iteration (after iteration 2 up to the last one)."""
    first, last = run.cum[1], run.cum[-1]
    n = len(run.cum) - 2

    def total(d: dict[str, int]) -> int:
        return sum(d.values()) if key is None else d.get(key, 0)

    return (total(last) - total(first)) / n


def _over_budget(run: _Run, budget: int) -> int:
    """Max over moments of (resident chunk bytes + traced non-model bytes) - device budget."""
    nm = run.stats["tracer"]["non_model_bytes"]
    worst = -budget
    for j, r in run.resident.items():
        if 0 <= j < len(nm):
            worst = max(worst, r + nm[j] - budget)
    return worst


# -- lower bounds -------------------------------------------------------------------------


def _simple_bound(n_chunks: int, chunk_bytes: int, max_allowed: int) -> int:
    """Compulsory fetches: every param chunk is used each iteration, at most
    floor(max_allowed / chunk_bytes) of them can stay on the device across the tightest moment."""
    return max(0, n_chunks - max(0, max_allowed) // chunk_bytes) * chunk_bytes


def _trace_bound(
    uses: dict[int, list[int]],
    non_model: list[int],
    budget: int,
    chunk_bytes: int,
    host_adam: set[int],
) -> int:
    """A tighter bound from the traced use lists, for a split moment s of the iteration:

    - a chunk whose Adam runs on the host ends the iteration on the host, so it is fetched at
      least once before or at s if it is used by then;
    - of the chunks used after s, at most K_s = floor(A_s / chunk_bytes) are on the device
      during s (A_s = budget - max(N_s, N_{s+1})), the others are fetched after s.
    The two sets of fetches are disjoint in time, so their sum bounds the iteration's fetches;
    the best s gives the bound. It holds if the device budget is respected at s.
    """
    best = 0
    for s in range(len(non_model)):
        around = max(non_model[s], non_model[min(s + 1, len(non_model) - 1)])
        k = max(0, budget - around) // chunk_bytes
        before = sum(1 for i, m in uses.items() if i in host_adam and m and m[0] <= s)
        after = sum(1 for m in uses.values() if m and m[-1] > s)
        best = max(best, before + max(0, after - k))
    return best * chunk_bytes


def _workload(
    model: str,
    layers: int,
    vocab: int | None,
    batch: int,
    seq: int,
    iters: int,
    chunk_size: int | None,
) -> tuple[Any, Callable[[], GPT], int, list[torch.Tensor]]:
    """The zoo model with its layer count (and vocabulary) overridden, a builder for it,
    the chunk size (given, or ~12-20 param chunks), and one random batch per iteration."""
    overrides: dict[str, Any] = {"num_layers": layers}
    if vocab is not None:
        overrides["vocab_size"] = vocab
    cfg = dataclasses.replace(get_config(model), **overrides)
    if seq > cfg.seq_len:
        raise ValueError(f"seq {seq} exceeds {model}'s seq_len {cfg.seq_len}")

    def model_fn() -> GPT:
        return build(cfg)

    if chunk_size is None:
        chunk_size = choose_chunk_size(_param_numels(model_fn))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen) for _ in range(iters)]
    return cfg, model_fn, chunk_size, batches


# -- eviction benchmark -------------------------------------------------------------------


def run_eviction(
    model: str = "gpt-small",
    layers: int = 8,
    batch: int = 4,
    seq: int = 128,
    chunk_size: int | None = None,
    iters: int = 4,
    json_out: bool = False,
    vocab: int | None = 1024,
    fractions: tuple[float, ...] = BUDGET_FRACTIONS,
    policies: tuple[str, ...] = POLICIES,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Host<->device bytes per steady iteration for each eviction policy and device budget.

    Device budget = measured peak non-model bytes N (activations etc., from an unconstrained
    run's tracer) + f x M, M the chunk bytes of all four lists (params, fp32 masters,
    momentum, variance), for each f in `fractions`: from tight to everything fitting. OPT
    and LRU place optimizer states on the device when the trace leaves a margin for them;
    'static' is a faithful static partition: f x M of the device for chunks, fixed before
    training without a tracer (static_model_share), optimizer states always on the host,
    Adam always there. `vocab` overrides the model's
    vocabulary (None keeps it): a chunk must hold the largest tensor, and gpt-small's
    8192 x 256 embedding would otherwise allow at most 4 param chunks at 8 layers, leaving
    eviction no choices. `chunk_size` None picks one giving ~12-20 param chunks. `dtype`
    is the engine's (auto: what it picks on this CPU).
    """
    dtype = bench_dtype(dtype)
    if iters < 3:
        raise ValueError("iters must be >= 3: iteration 1 traces, 2 places, 3+ are steady")
    cfg, model_fn, chunk_size, batches = _workload(
        model, layers, vocab, batch, seq, iters, chunk_size
    )

    def engine_cfg(memory: dict[str, Any]) -> dict[str, Any]:
        return {
            "dtype": dtype,
            "chunk_size": chunk_size,
            "optimizer": {"lr": 1e-4},
            "memory": {"disk_budget": 0, **memory},
        }

    console = _console()
    load_before = load_avg()
    t_start = time.perf_counter()
    console.print(f"[dim]unconstrained run of {model} ({layers} layers) to measure P and N ...")
    base = _run_engine(model_fn, engine_cfg({}), batches)
    st = base.stats
    n_chunks = st["chunks"]["param"]["count"]
    P = st["chunks"]["param"]["bytes"]
    c = P // n_chunks
    N = st["tracer"]["peak_non_model_bytes"]
    M = st["chunk_bytes"]
    non_model = st["tracer"]["non_model_bytes"]
    unused = [i for i in range(n_chunks) if not base.param_uses.get(i)]
    if unused:  # the bounds assume every param chunk is used in each iteration
        console.print(f"[yellow]param chunks never used in an iteration: {unused}")

    runs: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in policies}
    budget_bytes: dict[str, int] = {}
    labels = [f"{f:g}" for f in fractions]
    for f, pct in zip(fractions, labels, strict=True):
        budget = int(N + f * M)
        budget_bytes[pct] = budget
        for policy in policies:
            memory: dict[str, Any] = {"device_budget": budget, "policy": policy}
            if policy == "static":
                memory["static_model_share"] = min(1.0, f * M / budget)
            row: dict[str, Any] = {"budget": budget}
            try:
                r = _run_engine(model_fn, engine_cfg(memory), batches)
            except MemoryBudgetError as e:
                row.update(status="infeasible", error=str(e).splitlines()[0])
                console.print(f"[dim]{policy:>6} @ {pct:>4}: infeasible ({row['error']})")
            else:
                row.update(
                    status="ok",
                    h2d=_per_iter(r, "host->device"),
                    d2h=_per_iter(r, "device->host"),
                    total=_per_iter(r, None),
                    over_budget=_over_budget(r, budget),
                    s_per_iter=sum(r.seconds[2:]) / len(r.seconds[2:]),
                    device_adam_chunks=r.stats["device_adam_chunks"],
                    peak_non_model=r.stats["tracer"]["peak_non_model_bytes"],
                    final_loss=r.losses[-1],
                )
                console.print(
                    f"[dim]{policy:>6} @ {pct:>4}: {row['h2d'] / MIB:.2f} MiB/iter host->device"
                )
            runs[policy][str(pct)] = row

    lower_bound: dict[str, int] = {}
    lower_bound_trace: dict[str, int] = {}
    for pct in labels:
        budget = budget_bytes[pct]
        # The chunk room at the tightest moment: budget - peak N = pct% x P (the static share).
        lower_bound[pct] = _simple_bound(n_chunks, c, budget - N)
        # Chunks whose Adam runs on the device need not come back from the host; take the
        # most any run placed there, so the bound holds for every policy.
        dev_adam = max((runs[p][pct].get("device_adam_chunks", 0) for p in policies), default=0)
        host_adam = set(range(dev_adam, n_chunks))
        lower_bound_trace[pct] = _trace_bound(base.param_uses, non_model, budget, c, host_adam)
    load_after = load_avg()

    def by_policy(key: str) -> dict[str, dict[str, float | str]]:
        return {
            p: {
                pct: (row[key] if row["status"] == "ok" else "infeasible")
                for pct, row in runs[p].items()
            }
            for p in policies
        }

    result: dict[str, Any] = {
        "model": model,
        "layers": layers,
        "vocab": cfg.vocab_size,
        "hidden": cfg.hidden_size,
        "batch": batch,
        "seq": seq,
        "iters": iters,
        "params": num_params(cfg),
        "chunk_size": chunk_size,
        "chunk_bytes": c,
        "param_chunks": n_chunks,
        "param_chunk_bytes_total": P,
        "peak_non_model_bytes": N,
        "model_data_chunk_bytes": M,
        "budget_fractions": list(fractions),
        "budgets": budget_bytes,
        "bytes_moved": by_policy("h2d"),
        "total_moved": by_policy("total"),
        "sp_over_opt_total": _ratio_of_sums(runs, "static", "opt", "total"),
        "over_budget": by_policy("over_budget"),
        "lower_bound": lower_bound,
        "lower_bound_trace": lower_bound_trace,
        "runs": runs,
        "seconds": time.perf_counter() - t_start,
        **machine(dtype),
        "load_avg": {"before": load_before, "after": load_after},
    }
    _print_eviction(console, result)
    return finish(console, result, load_before, load_after, json_out)


def _ratio_of_sums(runs: dict[str, Any], a: str, b: str, key: str) -> float | None:
    """sum over the budgets both ran at of a's `key` / the same sum of b's (a ratio of sums,
    since b may move nothing at all at the larger budgets)."""
    if a not in runs or b not in runs:
        return None
    both = [pct for pct, row in runs[a].items() if row["status"] == runs[b][pct]["status"] == "ok"]
    num = sum(runs[a][pct][key] for pct in both)
    den = sum(runs[b][pct][key] for pct in both)
    return num / den if den else None


def _ratio_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mib(x: float) -> str:
    return f"{x / MIB:.2f}"


def _print_eviction(console: Console, r: dict[str, Any]) -> None:
    table = Table(
        title=(
            f"eviction traffic per steady iteration: {r['model']} ({r['layers']} layers, "
            f"vocab {r['vocab']}, {r['params'] / 1e6:.1f}M params), {r['compute_dtype']} on CPU "
            f"{r['cpu_capability']}, batch {r['batch']} x seq {r['seq']}, {r['param_chunks']} "
            f"param chunks of {_mib(r['chunk_bytes'])} MiB"
        )
    )
    cols = (
        "policy",
        "budget",
        "device MiB",
        "host->device MiB/iter",
        "total moved MiB/iter",
        "bound MiB",
        "trace bound MiB",
        "h2d ÷ trace bound",
        "over budget MiB",
        "s/iter",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for policy, rows in r["runs"].items():
        for pct, row in rows.items():
            lb, tb = r["lower_bound"][pct], r["lower_bound_trace"][pct]
            if row["status"] != "ok":
                table.add_row(policy, pct, _mib(row["budget"]), "infeasible", *[""] * 6)
                continue
            table.add_row(
                policy,
                pct,
                _mib(row["budget"]),
                _mib(row["h2d"]),
                _mib(row["total"]),
                _mib(lb),
                _mib(tb),
                f"{row['h2d'] / tb:.2f}" if tb else "-",
                _mib(max(0, row["over_budget"])),
                f"{row['s_per_iter']:.2f}",
            )
        table.add_section()
    console.print(table)
    console.print(
        f"Budget = peak non-model N {_mib(r['peak_non_model_bytes'])} MiB (measured by the tracer, "
        f"unconstrained run) + f x the chunks of all four lists M "
        f"{_mib(r['model_data_chunk_bytes'])} MiB (param chunks P "
        f"{_mib(r['param_chunk_bytes_total'])} MiB). Bytes moved: (cumulative after the last "
        f"iteration - after iteration 2) / {r['iters'] - 2}. static ÷ opt, total bytes moved "
        f"summed over the sweep: {_ratio_text(r['sp_over_opt_total'])}.\n"
        "bound: (param chunks - floor((budget - N) / chunk bytes)) x chunk bytes, a lower bound "
        "on fetches (every param chunk is used each iteration; at most that many stay resident "
        "across the peak moment).\ntrace bound: also counts that a chunk whose Adam runs on the "
        "host must be fetched again before its next use (see _trace_bound); both assume the "
        "budget is respected.\nover budget: max over moments of chunk bytes on the device + "
        "traced non-model bytes - budget (0 = within budget).\n"
        f"{r['seconds']:.0f} s in all"
    )


# -- disk spill: prefetch on vs off ---------------------------------------------------------


def run_disk_prefetch(
    model: str = "gpt-small",
    layers: int = 8,
    batch: int = 4,
    seq: int = 128,
    chunk_size: int | None = None,
    iters: int = 5,
    trials: int = 3,
    depth: int = 2,
    json_out: bool = False,
    vocab: int | None = 1024,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Step time with model data spilled to disk, prefetch off vs on ([Note: prefetch]).

    The device holds N + 0.4 x M, the host a third of the chunk bytes, the rest lives in
    the spill file (in $PSTAR_SPILL_DIR or /tmp). Runs alternate off, on, off, on ...
    (`trials` pairs, in one process); each run's steady iterations (3+) give its s/iter,
    and the ratio on/off is taken per pair, the median reported. The spill file is read
    through the page cache, so a read is mostly a memory copy here: on a real disk the
    reads cost more and prefetch has more to hide. `dtype` is the engine's (auto: what it
    picks on this CPU).
    """
    dtype = bench_dtype(dtype)
    if iters < 3:
        raise ValueError("iters must be >= 3: iteration 1 traces, 2 places, 3+ are steady")
    cfg, model_fn, chunk_size, batches = _workload(
        model, layers, vocab, batch, seq, iters, chunk_size
    )
    console = _console()
    load_before = load_avg()
    t_start = time.perf_counter()
    base_cfg = {"dtype": dtype, "chunk_size": chunk_size, "optimizer": {"lr": 1e-4}}
    base = _run_engine(model_fn, {**base_cfg, "memory": {"disk_budget": 0}}, batches)
    N = base.stats["tracer"]["peak_non_model_bytes"]
    M = base.stats["chunk_bytes"]
    memory = {
        "device_budget": int(N + 0.4 * M),
        "host_budget": M // 3,
        "disk_budget": 2 * M,
    }
    per_iter: dict[str, list[float]] = {"off": [], "on": []}
    ratios: list[float] = []
    moved: dict[str, dict[str, int]] = {}
    losses: dict[str, list[float]] = {}
    prefetched: dict[str, int] = {}
    for trial in range(trials):
        for mode in ("off", "on"):
            mem = {**memory, "prefetch_moments": depth if mode == "on" else 0}
            r = _run_engine(model_fn, {**base_cfg, "memory": mem}, batches)
            steady = r.seconds[2:]
            per_iter[mode].append(sum(steady) / len(steady))
            moved[mode] = {k: v for k, v in r.stats["bytes_moved"].items() if "disk" in k}
            prefetched[mode] = r.stats["prefetched"].get("disk->host", 0)
            losses[mode] = r.losses
            secs = per_iter[mode][-1]
            console.print(f"[dim]trial {trial + 1} prefetch {mode}: {secs:.3f} s/iter")
        ratios.append(per_iter["on"][-1] / per_iter["off"][-1])
    load_after = load_avg()
    result = {
        "model": model,
        "layers": layers,
        "params": num_params(cfg),
        "chunk_size": chunk_size,
        "model_data_chunk_bytes": M,
        "memory": memory,
        "prefetch_moments": depth,
        "s_per_iter": {k: median(v) for k, v in per_iter.items()},
        "disk_bytes_moved": moved,
        "prefetched_chunks": prefetched,
        "same_losses": losses["on"] == losses["off"],
        "ratio_on_over_off": median(ratios),
        "ratios": ratios,
        "trials": trials,
        "seconds": time.perf_counter() - t_start,
        **machine(dtype),
        "load_avg": {"before": load_before, "after": load_after},
    }
    table = Table(
        title=(
            f"disk spill, prefetch off vs on: {model} ({layers} layers, "
            f"{num_params(cfg) / 1e6:.1f}M params), {dtype} on CPU {result['cpu_capability']}, "
            f"batch {batch} x seq {seq}; device "
            f"{_mib(memory['device_budget'])} MiB, host {_mib(memory['host_budget'])} MiB, "
            f"model data {_mib(M)} MiB"
        )
    )
    for col in ("prefetch", "s/iter (median)", "disk->host MiB", "host->disk MiB", "prefetched"):
        table.add_column(col, justify="right")
    for mode in ("off", "on"):
        table.add_row(
            mode,
            f"{result['s_per_iter'][mode]:.3f}",
            _mib(moved[mode].get("disk->host", 0)),
            _mib(moved[mode].get("host->disk", 0)),
            str(prefetched[mode]),
        )
    console.print(table)
    console.print(
        f"on ÷ off, median of {trials} interleaved pairs: {result['ratio_on_over_off']:.3f} "
        f"(pairs: {', '.join(f'{x:.3f}' for x in ratios)}); losses identical: "
        f"{result['same_losses']}"
    )
    return finish(console, result, load_before, load_after, json_out)


if __name__ == "__main__":
    run_eviction(json_out=True)
