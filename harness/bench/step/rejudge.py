"""``dcp-harness bench rejudge``: a recorded ``bench step`` report's ratios and verdicts under this version's
statistics.

A report keeps every run's per-step times of every arm (``results.runs[k].arms[label].step_ms``), so when the
statistic that judges the targets changes (``summarise.paired_ratio``), the recorded runs can be judged again
without a GPU: each ratio per run and its median over runs, recomputed, beside the values the report was written
with. Nothing is measured; the step times are the report's own.
"""

from __future__ import annotations

from pathlib import Path

from harness.bench.step.summarise import RATIOS, checks, target_ratios
from harness.io import read_report
from harness.plan.errors import PlanInputError

JUDGED = ("speedup_vs_static", "ours_vs_upstream")
"""The ratios the targets judge (``summarise.checks``)."""


class RejudgeInputError(PlanInputError):
    """A file that is no ``bench step`` report, or one without the per-step times a ratio needs (names both)."""


def rejudge(path: str | Path) -> dict:
    """The report at ``path`` judged again: ``ratios`` (every ``RATIOS`` entry per run, median, min, max),
    ``recorded`` (the judged ratios as the report has them), ``checks`` (``summarise.checks`` on the new ratios) and
    ``recorded_checks``; raises ``RejudgeInputError`` naming the file and what it lacks."""
    p = Path(path)
    doc = read_report(p, ("step",), RejudgeInputError, "a 'dcp-harness bench step' report")
    res, cfg = doc["results"], doc.get("config") or {}
    runs = res.get("runs")
    if not isinstance(runs, list) or not runs:
        raise RejudgeInputError(f"{p}: its results hold no runs (results.runs); rerun dcp-harness bench step")
    for k, run in enumerate(runs):
        for label, arm in (run.get("arms") or {}).items():
            steps = arm.get("step_ms")
            if not isinstance(steps, list) or not steps:
                raise RejudgeInputError(f"{p}: run {k + 1}'s arm {label!r} has no per-step times (step_ms)")
    trim = cfg.get("trim", 0.1)
    try:
        ratios = target_ratios(runs, trim)
    except ValueError as e:  # step counts that differ between arms, a non-positive time
        raise RejudgeInputError(f"{p}: {e}") from None
    summary = {**res, "ratios": ratios}
    device = "cuda" if cfg.get("device") == "cuda" else "cpu"
    recorded = {name: (res.get("ratios") or {}).get(name) for name in RATIOS}
    return {"file": str(p), "commit": (doc.get("producer") or {}).get("git_rev"), "device": res.get("device_name"),
            "host": res.get("host_line") or None, "world": res.get("world"), "global_batch": (res.get("global_batch") or {}).get("mode"),
            "runs": len(runs), "trim": trim, "ratios": ratios, "recorded": recorded,
            "checks": checks(summary, device), "recorded_checks": doc.get("checks")}


def rows(results: list[dict]) -> list[dict]:
    """One row per report: the judged ratios recorded and now, per run and median, and the speedup's verdicts."""
    out = []
    for r in results:
        row = {"file": Path(r["file"]).name, "commit": r["commit"] or "-", "batch": r["global_batch"] or "-",
               "runs": r["runs"]}
        for name in JUDGED:
            now, then = r["ratios"].get(name) or {}, r["recorded"].get(name) or {}
            row[f"{name}_then"] = then.get("median")
            row[f"{name}_now"] = now.get("median")
            row[f"{name}_runs"] = " / ".join("-" if x is None else f"{x:.3f}" for x in now.get("per_run") or []) or None
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}
        speed = [c for c in r["checks"] if "speedup" in c["target"]]
        then = [c for c in (r["recorded_checks"] or []) if "speedup" in c.get("target", "")]
        row["verdict_then"] = verdict[then[0]["pass"]] if then else "-"
        row["verdict_now"] = verdict[speed[0]["pass"]] if speed else "-"
        out.append(row)
    return out


COLUMNS = [("file", "report", "s"), ("commit", "commit", "s"), ("batch", "batch", "s"), ("runs", "runs", "d"),
           ("speedup_vs_static_then", "speedup recorded", ".3f"), ("speedup_vs_static_now", "speedup now", ".3f"),
           ("speedup_vs_static_runs", "now per run", "s"), ("verdict_then", "verdict recorded", "s"),
           ("verdict_now", "verdict now", "s"), ("ours_vs_upstream_then", "vs upstream recorded", ".3f"),
           ("ours_vs_upstream_now", "vs upstream now", ".3f")]
"""The console table's columns (``harness.bench.common.table``)."""
