"""``dcp-harness bench replay``: a recorded megatron-core stack report's batches, scheduled again and priced under its
calibrated cost (``harness.bench.replay``)."""

from __future__ import annotations

from pathlib import Path

NAME = "replay"
HELP = "re-schedule a bench step --stack megatron-core report's batches with today's schedulers, priced by its calibration"
DESCRIPTION = ("Regenerates every measured batch of a 'bench step --stack megatron-core' JSON report, schedules it with "
               "each arm as the installed code does now, and simulates each schedule under the report's calibrated cost "
               "(synchronous model): per arm the predicted against the measured median, per pair of arms the predicted "
               "against the measured ratio. Writes reports/bench_replay.json. Needs megatron-core for its scheduler's arm.")


def add_arguments(p) -> None:
    p.add_argument("report", type=Path, metavar="BENCH_STEP_MEGATRON_CORE_JSON", help="the stack's report")
    p.add_argument("--arms", default="static,megatron-core,balanced",
                   help="comma list of static, megatron-core, balanced (default all three)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_replay.json)")


def run(a) -> int:
    from harness.bench.common import REPORTS
    from harness.bench.replay import console, load_report, replay
    from harness.golden import producer
    from harness.io import atomic_write_json

    result = replay(load_report(a.report), tuple(x.strip() for x in a.arms.split(",") if x.strip()))
    print(console(result, str(a.report)))
    out = a.out or REPORTS / "bench_replay.json"
    atomic_write_json(out, {"benchmark": "replay", "report": str(a.report), "producer": producer("bench replay"),
                            **result})
    print(f"wrote {out}")
    return 0
