"""``dcp-harness bench curve``: the speedup curve of several ``bench step`` reports (``harness.report.step_curve``)."""

from __future__ import annotations

from pathlib import Path

NAME = "curve"
HELP = "bench step's speedup over the global batch's size, from several of its JSON reports (table, JSON, HTML)"
DESCRIPTION = ("Reads bench step reports of one model on one machine, each of its own --global-batch, and shows the "
               "speedup of the dynamic-CP arm over static CP against sequences per step, with each run's model bound, "
               "the ratio to the upstream scheduler and MFU. Writes reports/bench_step_curve.json and .html.")


def add_arguments(p) -> None:
    p.add_argument("reports", nargs="+", type=Path, metavar="BENCH_STEP_JSON", help="bench step JSON reports")
    p.add_argument("--arm", default="dcp:balanced", help="the dynamic-CP arm whose speedup is drawn (dcp:balanced)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_step_curve.json)")
    p.add_argument("--html", type=Path, default=None, help="HTML path (default: the JSON's, .html)")


def run(a) -> int:
    from harness.bench.common import REPORTS
    from harness.io import atomic_write_json, atomic_write_text
    from harness.report.step_curve import console, html_page, load_curve

    points = load_curve(a.reports, a.arm)
    out = a.out or REPORTS / "bench_step_curve.json"
    html = a.html or out.with_suffix(".html")
    print(console(points))
    atomic_write_json(out, {"benchmark": "step_curve", "arm": a.arm, "points": points})
    atomic_write_text(html, html_page(points))
    print(f"wrote {out}\nwrote {html}")
    return 0
