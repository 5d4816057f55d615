"""``dcp-harness bench rejudge``: recorded ``bench step`` reports judged again under this version's statistics
(``harness.bench.step.rejudge``)."""

from __future__ import annotations

from pathlib import Path

NAME = "rejudge"
HELP = "bench step's ratios and target verdicts recomputed from recorded JSON reports (no GPU; table and JSON)"
DESCRIPTION = ("Reads bench step reports and recomputes each run's speedup over static CP and ratio to the upstream "
               "scheduler from the per-step times the reports hold, with this version's statistics, beside the values "
               "each report was written with, and the verdicts either way. Writes reports/bench_rejudge.json.")


def add_arguments(p) -> None:
    p.add_argument("reports", nargs="+", type=Path, metavar="BENCH_STEP_JSON", help="bench step JSON reports")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_rejudge.json)")


def run(a) -> int:
    from harness.bench.common import table, write_report
    from harness.bench.step.rejudge import COLUMNS, rejudge, rows

    results = [rejudge(p) for p in a.reports]
    print(table(rows(results), COLUMNS))
    print(f"wrote {write_report('rejudge', {'reports': [str(p) for p in a.reports]}, results, out=a.out)}")
    return 0
