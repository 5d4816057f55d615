"""Plots of scheduler results (matplotlib, Agg backend)."""

from __future__ import annotations

import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from harness.plan.layout import Schedule  # noqa: E402

PALETTE = {"balanced": "#1f77b4", "balanced[L2]": "#6baed6", "megatron-dev": "#d62728", "megatron-pr2000": "#ff9896",
           "dp-balanced": "#7f7f7f", "megatron-core": "#9467bd"}


def grouped_bars(rows: list[dict], metric: str, ylabel: str, log: bool = False, ref: float | None = None):
    """One group of bars per configuration (distribution, ranks, sequences), one bar per scheduler."""
    configs = list(dict.fromkeys((r["distribution"], r["ranks"], r["sequences"]) for r in rows))
    names = list(dict.fromkeys(r["scheduler"] for r in rows))
    val = {(r["distribution"], r["ranks"], r["sequences"], r["scheduler"]): r[metric] for r in rows}
    invalid = {(r["distribution"], r["ranks"], r["sequences"], r["scheduler"]) for r in rows if r.get("invalid_batches")}
    fig, ax = plt.subplots(figsize=(max(9, 1.3 * len(configs)), 4.0))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(configs))]
        ys = [val.get((*c, name), float("nan")) for c in configs]
        bars = ax.bar(xs, ys, width, label=name, color=PALETTE.get(name))
        for c, bar in zip(configs, bars):
            if (*c, name) in invalid:  # breaks an invariant: not a usable schedule
                bar.set_hatch("xxx")
                bar.set_edgecolor("white")
    if ref is not None:
        ax.axhline(ref, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f"{d}\n{n}r x {s}s" for d, n, s in configs], fontsize=7, rotation=25, ha="right")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    else:
        lo = min((v for v in val.values() if v == v), default=1.0)
        ax.set_ylim(bottom=max(0.0, min(1.0, lo) - 0.05))
    ax.legend(fontsize=7, ncol=len(names), loc="upper left")
    if invalid:
        ax.text(1.0, 1.01, "hatched: schedule breaks an invariant", transform=ax.transAxes, ha="right", fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return fig


def timelines(schedules: dict[str, Schedule], cost, step_times: dict[str, float]):
    """Rank x simulated-time Gantt chart per schedule: one rectangle per block a rank runs, coloured by
    the block's CP size; white gaps are time spent waiting for CP partners (or idle at the end)."""
    sizes = sorted({b.size for s in schedules.values() for mb in s.layout for b in mb})
    cmap = plt.get_cmap("viridis", max(len(sizes), 2))
    color = {sz: cmap(i) for i, sz in enumerate(sizes)}
    fig, axes = plt.subplots(len(schedules), 1, figsize=(11, 1.6 + 0.9 * len(schedules) * max(1, min(
        4, next(iter(schedules.values())).n_ranks / 16))), squeeze=False, sharex=True)
    horizon = max(step_times.values())
    for ax, (name, s) in zip(axes[:, 0], schedules.items()):
        free = [0.0] * s.n_ranks
        for mb in s.layout:
            for b in mb:
                start = max(free[b.start:b.start + b.size])
                dur = s.block_cost(b, cost)
                ax.add_patch(Rectangle((start, b.start), dur, b.size, facecolor=color[b.size], edgecolor="white", lw=0.4))
                free[b.start:b.start + b.size] = [start + dur] * b.size
        ax.set_xlim(0, horizon * 1.01)
        ax.set_ylim(s.n_ranks, 0)
        ax.set_ylabel("rank")
        ax.set_title(f"{name}: step time {step_times[name] / horizon:.3f} x the slowest schedule's, "
                     f"{s.num_microbatches} micro-batches", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("simulated time (cost-model units)")
    handles = [Rectangle((0, 0), 1, 1, facecolor=color[sz]) for sz in sizes]
    fig.legend(handles, [f"CP {sz}" for sz in sizes], loc="upper right", ncol=len(sizes), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def schedule_grids(schedules: dict[str, Schedule]):
    """Ranks x micro-batches per layout: one rectangle per CP block, coloured by its first sequence,
    labelled with its CP size."""
    import colorsys

    fig, axes = plt.subplots(1, len(schedules), figsize=(4.2 * len(schedules), 3.6), squeeze=False)
    for ax, (name, s) in zip(axes[0], schedules.items()):
        for m, mb in enumerate(s.layout):
            for b in mb:
                hue = (b.gids[0] * 0.6180339887) % 1.0
                ax.add_patch(Rectangle((m, b.start), 1, b.size, facecolor=colorsys.hsv_to_rgb(hue, 0.55, 0.95),
                                       edgecolor="black", lw=0.6))
                if b.size > 1 or s.n_ranks <= 8:
                    ax.text(m + 0.5, b.start + b.size / 2, f"{b.size}", ha="center", va="center", fontsize=6)
        ax.set_xlim(0, max(1, s.num_microbatches))
        ax.set_ylim(s.n_ranks, 0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("rank")
        ax.set_title(f"{name}: {s.num_microbatches} micro-batches", fontsize=9)
    fig.tight_layout()
    return fig


def layout_bars(rows: dict[str, list[dict]]):
    """Median tokens/s and padding fraction per layout."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3))
    names = list(rows)
    tps = [statistics.median(r["tokens_per_s"] for r in rows[n][1:] or rows[n]) for n in names]
    pad = [statistics.fmean(r["padding_fraction"] for r in rows[n]) for n in names]
    a.bar(names, tps, color="#4c72b0")
    a.set_title("real tokens / s (median step)", fontsize=9)
    b.bar(names, [100 * p for p in pad], color="#dd8452")
    b.set_title("padding (% of processed tokens)", fontsize=9)
    fig.tight_layout()
    return fig
