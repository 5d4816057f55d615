"""``dcp-harness bench replay``: a recorded megatron-core stack report's batches, scheduled again and priced under its
calibrated cost (``harness.bench.replay``)."""

from __future__ import annotations

from pathlib import Path

NAME = "replay"
HELP = "re-schedule a bench step report's batches with today's schedulers, priced by its calibrated cost"
DESCRIPTION = ("Regenerates every measured batch of a 'bench step' JSON report (the harness's runtime or --stack "
               "megatron-core), schedules it with each arm as the installed code does now, and simulates each schedule "
               "under the report's calibrated cost: per arm the predicted against the measured median, per pair of arms "
               "the predicted against the measured ratio. Writes reports/bench_replay.json. megatron-core's scheduler "
               "arm needs megatron-core installed.")


def add_arguments(p) -> None:
    p.add_argument("report", type=Path, metavar="BENCH_STEP_JSON", help="a bench step report of either stack")
    p.add_argument("--arms", default=None, help="comma list of the report's arms (default all of them)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_replay.json)")


def run(a) -> int:
    from harness.bench.common import REPORTS
    from harness.bench.replay import console, load_report, replay
    from harness.golden import producer
    from harness.io import atomic_write_json

    arms = tuple(x.strip() for x in a.arms.split(",") if x.strip()) if a.arms else None
    result = replay(load_report(a.report), arms)
    print(console(result, str(a.report)))
    out = a.out or REPORTS / "bench_replay.json"
    atomic_write_json(out, {"benchmark": "replay", "report": str(a.report), "producer": producer("bench replay"),
                            **result})
    print(f"wrote {out}")
    return 0
