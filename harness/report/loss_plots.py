"""The loss curves of a convergence run, with what sets the layouts apart drawn first.

In a passing run bshd, thd and dcp agree to ~1e-7: on a loss axis their curves are one line. So the
figure leads with the differences, ``|loss - bshd loss|`` per step on a log scale (the panel the eye
meets first), and the loss panel says in words that its curves overlap and by how much at most.
A difference of exactly 0 cannot sit on a log axis: it is drawn at a floor below the smallest non-zero
difference, with a hollow marker. A non-finite loss (NaN, inf) leaves a gap in its line and a red cross
at the top of both panels.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

STYLES = {"bshd": ("k", "-", 2.2), "thd": ("#ff7f0e", "--", 1.6), "dcp": ("#1f77b4", ":", 1.8)}
BAD = "#d62728"
LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}
"""Legends sit right of their panel: inside, they would hide the points they name."""
OVERLAP = 0.004
"""Differences below this fraction of the loss axis's span are under a pixel or two: the curves overlap."""


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def deltas(rows: dict[str, list[dict]], ref: str = "bshd") -> dict[str, list[float]]:
    """``|loss - ref loss|`` per step for every layout but ``ref`` (NaN where either is non-finite)."""
    base = rows[ref]
    return {layout: [abs(r["loss"] - b["loss"]) if _finite(r["loss"]) and _finite(b["loss"]) else math.nan
                     for r, b in zip(rs, base)]
            for layout, rs in rows.items() if rs is not base}


def max_text(d: list[float]) -> str:
    """The largest finite difference ("n/a" when none), and how many are non-finite."""
    finite = [x for x in d if _finite(x)]
    bad = len(d) - len(finite)
    text = f"{max(finite):.2e}" if finite else "n/a"
    return text + (f" ({bad} non-finite)" if bad else "")


def _mark_non_finite(ax, steps: list, label: str | None) -> None:
    """Red crosses at the top of ``ax`` over the given steps."""
    if steps:
        tr = blended_transform_factory(ax.transData, ax.transAxes)
        ax.plot(steps, [0.96] * len(steps), "x", color=BAD, ms=8, mew=2, transform=tr, clip_on=False, label=label)


def _difference_panel(ax, rows: dict, diffs: dict[str, list[float]], ref: str) -> None:
    positive = [x for d in diffs.values() for x in d if _finite(x) and x > 0]
    floor = min(positive) / 10 if positive else 1e-12
    top = max(positive) * 10 if positive else 1e-10
    for layout, d in diffs.items():
        c, ls, _ = STYLES.get(layout, (None, "-", 1.2))
        steps = [r["step"] for r in rows[layout]][:len(d)]
        ax.semilogy(steps, [x if not _finite(x) or x > 0 else floor for x in d], ls, color=c, lw=1.4, marker=".",
                    label=f"|{layout} - {ref}|  max {max_text(d)}")
        zeros = [s for s, x in zip(steps, d) if x == 0]
        if zeros:
            ax.plot(zeros, [floor] * len(zeros), "o", mfc="none", color=c, ms=6, label=f"{layout}: = 0 (at the floor)")
        _mark_non_finite(ax, [s for s, x in zip(steps, d) if not _finite(x)], f"{layout}: non-finite loss")
    ax.set_ylim(floor / 2, top)
    ax.set_ylabel(f"|loss - {ref} loss|\n(log scale)")
    ax.set_title(f"Difference to {ref} per step: where the layouts differ", fontsize=10, loc="left")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, **LEGEND)


def _loss_panel(ax, rows: dict, diffs: dict[str, list[float]], ref: str) -> None:
    for layout, rs in rows.items():
        c, ls, lw = STYLES.get(layout, (None, "-", 1.2))
        steps = [r["step"] for r in rs]
        ax.plot(steps, [r["loss"] if _finite(r["loss"]) else math.nan for r in rs], ls, color=c, lw=lw, label=layout)
        _mark_non_finite(ax, [r["step"] for r in rs if not _finite(r["loss"])], f"{layout}: non-finite loss")
    ax.set_ylabel("loss (per token)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(**LEGEND)
    if diffs:  # in the title, where no curve can hide it
        lo, hi = ax.get_ylim()
        worst = max((x for d in diffs.values() for x in d if _finite(x)), default=math.nan)
        each = ", ".join(f"{k} {max_text(d)}" for k, d in diffs.items())
        head = ("no finite loss to compare" if not _finite(worst) else
                "curves overlap" if worst <= OVERLAP * (hi - lo) else "curves differ")
        shown = f"{worst:.2e}" if _finite(worst) else "n/a"
        ax.set_title(f"Loss per step: {head}: max |delta| vs {ref} = {shown} ({each}); differences above",
                     fontsize=9, loc="left", bbox={"boxstyle": "round", "fc": "#fff8dc", "ec": "#c9b458"})


def loss_curves(rows: dict[str, list[dict]], ref: str = "bshd"):
    """|loss - ``ref`` loss| per step (top, log scale) and the loss curves (bottom) of every layout (the
    first layout is the reference when ``ref`` did not run)."""
    ref = ref if ref in rows else next(iter(rows))
    diffs = deltas(rows, ref)
    if not diffs:
        fig, loss = plt.subplots(figsize=(11.5, 3.6))
        _loss_panel(loss, rows, diffs, ref)
    else:
        fig, (diff, loss) = plt.subplots(2, 1, figsize=(11.5, 6.2), sharex=True, height_ratios=[2, 3])
        _difference_panel(diff, rows, diffs, ref)
        _loss_panel(loss, rows, diffs, ref)
    fig.tight_layout()
    return fig
