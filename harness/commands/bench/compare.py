"""``dcp-harness bench compare``: the harness's runtime and megatron-core's step side by side
(``harness.report.step_stacks``)."""

from __future__ import annotations

from pathlib import Path

NAME = "compare"
HELP = "the harness's runtime and megatron-core's own step side by side, from bench step reports (table, JSON, HTML)"
DESCRIPTION = ("Reads reports of bench step (the harness's runtime) and of bench step --stack megatron-core and puts "
               "each workload's arms in one table: static CP, the upstream scheduler and balanced on each stack, the "
               "speedups and balanced's MFU. Writes reports/bench_step_compare.json and .html.")


def add_arguments(p) -> None:
    p.add_argument("reports", nargs="+", type=Path, metavar="BENCH_STEP_JSON",
                   help="bench step and bench step --stack megatron-core JSON reports")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_step_compare.json)")
    p.add_argument("--html", type=Path, default=None, help="HTML path (default: the JSON's, .html)")


def run(a) -> int:
    from harness.bench.common import REPORTS
    from harness.io import atomic_write_json, atomic_write_text
    from harness.report.step_stacks import console, html_page, load_rows

    rows = load_rows(a.reports)
    out = a.out or REPORTS / "bench_step_compare.json"
    html = a.html or out.with_suffix(".html")
    print(console(rows))
    atomic_write_json(out, {"benchmark": "step_compare", "rows": rows})
    atomic_write_text(html, html_page(rows))
    print(f"wrote {out}\nwrote {html}")
    return 0
