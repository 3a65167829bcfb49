"""Plot the warm-up memory trace of a run: what `pstar plot-trace RUN_DIR` draws.

This module owns the PNG of the engine's per-moment memory (`plot_trace`, from a stats dict as
returned by `engine.stats()`) and the run-directory entry point (`plot_run_dir`, which reads
`RUN_DIR/trace.json` written by the training loop). Per moment (operator start) it draws the
traced non-model bytes N_i, the chunk bytes on the device C_i, their sum, the device budget and
the chunk room A_i = budget - max(N_i, N_{i+1}) that eviction works within, with the forward,
backward and Adam regions shaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers and in tests

import matplotlib.pyplot as plt

__all__ = ["memory_stats", "plot_run_dir", "plot_trace"]

_REGIONS = (
    ("fwd:", "forward", "#dbeafe"),
    ("bwd:", "backward", "#fee2e2"),
    ("adam", "adam", "#dcfce7"),
)


def _region(name: str) -> str:
    for prefix, label, _ in _REGIONS:
        if name.startswith(prefix):
            return label
    return "other"


def _spans(names: list[str]) -> list[tuple[str, int, int]]:
    """Consecutive runs of moments in the same region: (label, first, last)."""
    spans: list[tuple[str, int, int]] = []
    for i, name in enumerate(names):
        label = _region(name)
        if spans and spans[-1][0] == label:
            spans[-1] = (label, spans[-1][1], i)
        else:
            spans.append((label, i, i))
    return spans


def _unit(peak: float) -> tuple[str, float]:
    if peak >= 2**30:
        return "GiB", 2.0**30
    if peak >= 2**20:
        return "MiB", 2.0**20
    return "KiB", 2.0**10


def plot_trace(stats: dict[str, Any], out: Path, title: str | None = None) -> Path:
    """Write a PNG of the traced memory per moment from `engine.stats()`; returns `out`."""
    tr = stats.get("tracer") or {}
    names: list[str] = list(tr.get("names") or [])
    nm: list[int] = list(tr.get("non_model_bytes") or [])
    cb: list[int] = list(tr.get("chunk_bytes") or [])
    if not names or len(nm) != len(names) or len(cb) != len(names):
        raise ValueError(
            "the stats hold no memory trace (tracer moments 0); train at least one iteration "
            "before taking engine.stats()"
        )
    budget = (stats.get("tiers") or {}).get("device", {}).get("budget")
    total = [n + c for n, c in zip(nm, cb, strict=True)]
    top = max(total)
    # A whole-machine budget (no device_budget set) would flatten every curve; leave it off
    # the axes and say so in the legend instead.
    budget_on_scale = budget is not None and budget <= 3 * top
    unit, scale = _unit(max(top, budget if budget_on_scale else 0))
    xs = list(range(len(names)))

    fig, ax = plt.subplots(figsize=(12, 6), dpi=110)
    for label, first, last in _spans(names):
        color = next((c for _, lab, c in _REGIONS if lab == label), "#f3f4f6")
        ax.axvspan(first - 0.5, last + 0.5, color=color, zorder=0, lw=0)
        ax.text(
            (first + last) / 2,
            1.0,
            label,
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=9,
            color="#374151",
        )
    ax.stackplot(
        xs,
        [c / scale for c in cb],
        [n / scale for n in nm],
        labels=["chunk bytes on the device C_i (warm-up)", "non-model N_i (activations, temps)"],
        colors=["#60a5fa", "#f59e0b"],
        alpha=0.75,
        step="post",
        zorder=2,
    )
    ax.step(
        xs, [t / scale for t in total], where="post", color="#111827", lw=1.2,
        label="C_i + N_i", zorder=3,
    )  # fmt: skip
    if budget_on_scale:
        ax.axhline(
            budget / scale, color="#dc2626", ls="--", lw=1.4,
            label=f"device budget {budget / scale:.1f} {unit}", zorder=4,
        )  # fmt: skip
        room = [max(0, budget - max(nm[i], nm[min(i + 1, len(nm) - 1)])) / scale for i in xs]
        ax.step(
            xs, room, where="post", color="#7c3aed", ls=":", lw=1.4,
            label="chunk room A_i = budget - max(N_i, N_i+1)", zorder=4,
        )  # fmt: skip
    elif budget is not None:
        ax.plot([], [], " ", label=f"device budget {budget / 2**30:.1f} GiB (off scale)")
    peak = max(xs, key=lambda i: nm[i])
    ax.annotate(
        f"peak N {nm[peak] / scale:.1f} {unit}\n{names[peak]}",
        xy=(peak, total[peak] / scale),
        xytext=(10, 10),
        textcoords="offset points",
        fontsize=8,
        arrowprops={"arrowstyle": "->", "lw": 0.8},
        zorder=5,
    )
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_ylim(0, None)
    ax.set_xlabel("moment (operator start), warm-up iteration")
    ax.set_ylabel(unit)
    ax.grid(axis="y", alpha=0.3, zorder=1)
    # Below the axes: inside, it would hide the start of the curves or the budget line.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=8, frameon=False)

    params = stats.get("params")
    info = [
        f"{params / 1e6:.1f}M params" if params else None,
        stats.get("dtype"),
        f"chunk {stats['chunk_size']:,} elements" if stats.get("chunk_size") else None,
        f"{len(names)} moments",
        f"peak non-model {tr.get('peak_non_model_bytes', max(nm)) / 2**20:.1f} MiB",
    ]
    head = f"{title}: " if title else ""
    ax.set_title(
        head + "memory per moment — " + ", ".join(i for i in info if i), fontsize=10, pad=16
    )
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def memory_stats(memory: dict[str, Any]) -> dict[str, Any]:
    """The API's `GET .../memory` answer in the shape `plot_trace` takes: the PNG of a
    service job draws the very numbers its dashboard page plots."""
    return {
        "tracer": {
            "names": memory["names"],
            "non_model_bytes": memory["non_model_bytes"],
            "chunk_bytes": memory["chunk_bytes"],
            "peak_non_model_bytes": memory["peak_non_model_bytes"],
        },
        "tiers": memory.get("tiers") or {},
    }


def plot_run_dir(run_dir: Path, out: Path | None = None) -> Path:
    """Plot `run_dir/trace.json` (written by `pstar train`) to `out` (default run_dir/trace.png)."""
    run_dir = Path(run_dir)
    trace = run_dir / "trace.json"
    if not trace.is_file():
        raise FileNotFoundError(f"no trace.json in {run_dir}; run pstar train first")
    stats = json.loads(trace.read_text())
    title = run_dir.name
    summary = run_dir / "summary.json"
    if summary.is_file():
        # The model name lives in the run summary, not in the engine stats.
        try:
            model = json.loads(summary.read_text()).get("model")
        except (json.JSONDecodeError, AttributeError):
            model = None
        if model:
            title = f"{run_dir.name} ({model})"
    return plot_trace(stats, out if out is not None else run_dir / "trace.png", title=title)
