"""The speedup curve of ``bench step`` over the global batch's size, from several of its JSON reports.

``dcp-harness bench curve A.json B.json ...`` reads ``bench step`` reports of one model on one machine (each a
``--global-batch`` of its own: ``megatron``, ``sequences:K``, ``tokens``), orders them by sequences per step and
shows, per point, the dynamic-CP arm's speedup over static CP (median over runs and their range), the model bound
of the run, the ratio to the upstream scheduler and the arm's MFU: as a table, a JSON and an HTML page with the
curve plotted against its bound and the target. Points from different commits are allowed (each names its
own); points of another model, world or device are refused, naming the file.
"""

from __future__ import annotations

from pathlib import Path

from harness.io import read_report
from harness.plan import PlanInputError
from harness.report.html import esc, figure_png, page, table
from harness.report.text import aligned

TARGET = 1.4
"""The step benchmark's speedup target at 4 GPUs, drawn as a line."""


class CurveInputError(PlanInputError):
    """A file that is no ``bench step`` report, or a point that does not belong on the curve (names both)."""


def _ratio(results: dict, key: str, path: Path) -> dict:
    r = (results.get("ratios") or {}).get(key)
    if not isinstance(r, dict) or r.get("median") is None:
        raise CurveInputError(f"{path}: no '{key}' ratio in its results; rerun dcp-harness bench step to write it")
    return r


def load_point(path: str | Path, arm: str = "dcp:balanced") -> dict:
    """One point of the curve from a ``bench step`` JSON (raises ``CurveInputError`` naming the file and what it
    lacks)."""
    p = Path(path)
    doc = read_report(p, ("step",), CurveInputError, "a 'dcp-harness bench step' report")
    res, cfg = doc["results"], doc.get("config") or {}
    arms = res.get("arms") or {}
    if arm not in arms:
        raise CurveInputError(f"{p} has no arm {arm!r} (it has {', '.join(arms) or 'none'}): choose one with --arm")
    gb = res.get("global_batch") or {}
    if gb.get("sequences_mean") is None:
        raise CurveInputError(f"{p}: its results do not say how many sequences a step had (results.global_batch)")
    speed = _ratio(res, "speedup_vs_static", p)
    bound = (res.get("ratios") or {}).get("speedup_bound") or {}
    upstream = (res.get("ratios") or {}).get("ours_vs_upstream") or {}
    return {"file": str(p), "sequences": float(gb["sequences_mean"]), "tokens": gb.get("tokens_mean"),
            "mode": gb.get("mode"), "speedup": speed["median"], "speedup_runs": list(speed.get("per_run") or []),
            "bound": bound.get("median"), "vs_upstream": upstream.get("median"), "mfu": arms[arm].get("mfu"),
            "ms": arms[arm].get("trimmed_mean_ms"), "arm": arm, "model": cfg.get("model"), "world": res.get("world"),
            "device": res.get("device_name"), "commit": (doc.get("producer") or {}).get("git_rev")}


def load_curve(paths, arm: str = "dcp:balanced") -> list[dict]:
    """The points of ``paths`` ordered by sequences per step; they must share model, world and device."""
    points = [load_point(p, arm) for p in paths]
    if not points:
        raise CurveInputError("give at least one bench step JSON")
    first = points[0]
    for pt in points[1:]:
        for key in ("model", "world", "device"):
            if pt[key] != first[key]:
                raise CurveInputError(f"{pt['file']} has {key} {pt[key]!r}, {first['file']} {first[key]!r}: one curve "
                                      f"is one model on one machine")
    return sorted(points, key=lambda pt: pt["sequences"])


HEADER = ["sequences a step", "tokens a step", "speedup (median)", "runs", "model bound", "vs upstream", "MFU",
          "step ms", "commit", "file"]


def rows(points: list[dict]) -> list[list]:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    return [[f(pt["sequences"], ".0f"), f(pt["tokens"], ".0f"), f(pt["speedup"], ".3f"),
             " / ".join(format(x, ".3f") for x in pt["speedup_runs"]) or "-", f(pt["bound"], ".3f"),
             f(pt["vs_upstream"], ".3f"), f(pt["mfu"], ".3f"), f(pt["ms"], ".1f"), pt["commit"] or "-",
             Path(pt["file"]).name] for pt in points]


def console(points: list[dict]) -> str:
    """The curve as an aligned text table."""
    return aligned(HEADER, rows(points))


def figure(points: list[dict]):
    """Speedup over static CP against sequences per step (log 2): the medians with their runs' range, the model
    bound and the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    x = [pt["sequences"] for pt in points]
    med = [pt["speedup"] for pt in points]
    lo = [m - min(pt["speedup_runs"] or [m]) for m, pt in zip(med, points)]
    hi = [max(pt["speedup_runs"] or [m]) - m for m, pt in zip(med, points)]
    ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=4, label=f"{points[0]['arm']} / static CP (median, runs)")
    bx = [pt["sequences"] for pt in points if pt["bound"] is not None]
    if bx:
        ax.plot(bx, [pt["bound"] for pt in points if pt["bound"] is not None], "--", marker="s", color="gray",
                label="model bound (any schedule)")
    ax.axhline(TARGET, color="tab:red", lw=1, ls=":", label=f"target {TARGET}x")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences a step")
    ax.set_ylabel("speedup over static CP")
    ax.set_title(f"{points[0]['model']} on {points[0]['world']} x {points[0]['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def html_page(points: list[dict]) -> str:
    head = points[0]
    body = (f"<h1>bench step: speedup over the global batch's size</h1><p class=\"meta\">{esc(head['model'])}, "
            f"{esc(head['world'])} x {esc(head['device'])}, arm {esc(head['arm'])}; each point one "
            f"<code>dcp-harness bench step</code> report (its commit in the table)</p>"
            + figure_png(figure(points)) + table(rows(points), HEADER, left=0))
    return page("bench step speedup curve", body)
