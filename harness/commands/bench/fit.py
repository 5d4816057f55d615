"""``dcp-harness bench fit``: a cost model fitted to the whole measured steps of ``bench step`` reports
(``harness.bench.fit``)."""

from __future__ import annotations

from pathlib import Path

NAME = "fit"
HELP = "fit bench step's cost model to the measured steps of its reports, each report held out in turn"
DESCRIPTION = ("Prices every measured step of every arm of the harness runtime's bench step reports (schedules "
               "regenerated as they ran) and fits the cost model's coefficients and a per-step overhead to the measured "
               "step times; with several reports, holds each out in turn and compares the fitted and the calibrated "
               "model's predicted ratios of its arms with the measured ones. Writes reports/bench_fit.json, usable as "
               "bench step --cost-model.")


def add_arguments(p) -> None:
    p.add_argument("reports", nargs="+", type=Path, metavar="BENCH_STEP_JSON", help="bench step reports (one world)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_fit.json)")


def run(a) -> int:
    from harness.bench.common import REPORTS
    from harness.bench.fit import console, fit
    from harness.golden import producer
    from harness.io import atomic_write_json

    out = a.out or REPORTS / "bench_fit.json"
    import sys

    result = fit(a.reports, progress=lambda text: print(f"bench fit: {text}", file=sys.stderr, flush=True))
    print(console(result))
    atomic_write_json(out, {"benchmark": "fit", "producer": producer("bench fit"), "results": result})
    print(f"wrote {out} (bench step --cost-model {out})")
    return 0
