"""The harness's runtime and megatron-core's own step, side by side, from ``bench step`` reports.

``dcp-harness bench compare A.json B.json ...`` reads reports of ``bench step`` (the harness's runtime:
``thd:dp-balanced``, ``dcp:balanced``, ``dcp:megatron-dev``) and of ``bench step --stack megatron-core`` (static
CP, megatron-core's own scheduler, ``balanced`` fed to megatron-core) and puts each workload's arms in one table:
static CP, the upstream scheduler and ``balanced`` on each stack, with the speedups over static CP, ``balanced``
against the upstream scheduler and ``balanced``'s MFU. A row is one report; rows of one model, workload and GPU
count sit together so the two stacks read side by side.
"""

from __future__ import annotations

from pathlib import Path

from harness.io import read_report
from harness.plan import PlanInputError
from harness.report.html import esc, page, table
from harness.report.text import aligned

RUNTIME = {"static": "thd:dp-balanced", "upstream": "dcp:megatron-dev", "balanced": "dcp:balanced"}
STACK = {"static": "static", "upstream": "megatron-core", "balanced": "balanced"}
STACK_RATIOS = {"upstream_vs_static": "megatron-core dynamic CP vs static CP", "balanced_vs_static": "balanced vs static CP",
                "balanced_vs_upstream": "balanced vs megatron-core's scheduler"}


class CompareInputError(PlanInputError):
    """A file that is no ``bench step`` report of either stack, or one that lacks an arm (names both)."""


def _median(results: dict, key: str):
    r = (results.get("ratios") or {}).get(key) or {}
    return r.get("median")


def load_row(path: str | Path) -> dict:
    """One report as a row: its stack, workload and the three arms' step times, speedups and ``balanced``'s MFU."""
    p = Path(path)
    doc = read_report(p, ("step", "step_megatron_core"), CompareInputError,
                      "a 'dcp-harness bench step' report of either stack")
    kind = doc["benchmark"]
    res, cfg = doc["results"], doc.get("config") or {}
    names = RUNTIME if kind == "step" else STACK
    arms = res.get("arms") or {}
    missing = [a for a in names.values() if a not in arms]
    if missing:
        raise CompareInputError(f"{p} has no arm {missing[0]!r} (it has {', '.join(arms) or 'none'}): run its "
                                f"benchmark with the default arms")
    ms_key = "trimmed_mean_ms" if kind == "step" else "median_ms"
    ms = {role: arms[a].get(ms_key) for role, a in names.items()}
    if kind == "step":
        ratios = {"upstream_vs_static": ms["static"] / ms["upstream"] if ms["static"] and ms["upstream"] else None,
                  "balanced_vs_static": _median(res, "speedup_vs_static"),
                  "balanced_vs_upstream": _median(res, "ours_vs_upstream")}
    else:
        ratios = {k: _median(res, name) for k, name in STACK_RATIOS.items()}
    return {"file": str(p), "stack": "harness" if kind == "step" else "megatron-core", "model": cfg.get("model"),
            "workload": cfg.get("global_batch", "tokens"), "gpus": res.get("world") or res.get("gpus") or cfg.get("gpus"),
            "device": res.get("device_name") or res.get("device"), "ms": ms, **ratios,
            "mfu": arms[names["balanced"]].get("mfu"), "commit": (doc.get("producer") or {}).get("git_rev")}


def load_rows(paths) -> list[dict]:
    """Rows ordered by model, workload, GPUs, then the harness before megatron-core."""
    rows = [load_row(p) for p in paths]
    if not rows:
        raise CompareInputError("give at least one bench step JSON")
    return sorted(rows, key=lambda r: (str(r["model"]), str(r["workload"]), r["gpus"] or 0, r["stack"] != "harness"))


HEADER = ["model", "workload", "GPUs", "stack", "static CP ms", "upstream scheduler ms", "balanced ms",
          "upstream vs static", "balanced vs static", "balanced vs upstream", "MFU of balanced", "commit", "file"]


def cells(rows: list[dict]) -> list[list]:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    return [[r["model"] or "-", r["workload"], f(r["gpus"], "d"), r["stack"], f(r["ms"]["static"], ".1f"),
             f(r["ms"]["upstream"], ".1f"), f(r["ms"]["balanced"], ".1f"), f(r["upstream_vs_static"], ".3f"),
             f(r["balanced_vs_static"], ".3f"), f(r["balanced_vs_upstream"], ".3f"), f(r["mfu"], ".3f"),
             r["commit"] or "-", Path(r["file"]).name] for r in rows]


def console(rows: list[dict]) -> str:
    """The rows as an aligned text table."""
    return aligned(HEADER, cells(rows))


def html_page(rows: list[dict]) -> str:
    devices = sorted({str(r["device"]) for r in rows})
    body = ("<h1>bench step: the harness's runtime and megatron-core's step, side by side</h1>"
            f"<p class=\"meta\">{esc(', '.join(devices))}; upstream scheduler = <code>dcp:megatron-dev</code> on the "
            "harness's runtime, megatron-core's own <code>BalancedCPScheduler</code> on megatron-core; ratios > 1: "
            "the second faster</p>" + table(cells(rows), HEADER, left=4))
    return page("bench step: two stacks", body)
