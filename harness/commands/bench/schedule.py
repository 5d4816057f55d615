"""``dcp-harness bench schedule``: scheduler latency and quality against upstream and the lower bound."""

from __future__ import annotations

from harness import cli_types as T
from harness.bench.schedule import main
from harness.commands.common import add_out

NAME = "schedule"
HELP = "scheduler latency and quality vs upstream and the lower bound"
DESCRIPTION = None


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="3 configurations instead of 6, a smaller input family")
    p.add_argument("--batches", type=T.BATCHES, default=5, help="global batches per configuration (default 5)")
    add_out(p, "bench_schedule.json")
    p.add_argument("--execution", choices=["independent", "synchronous", "all"], default="all",
                   help="execution models whose targets the seeded input family checks (default all)")
    p.add_argument("--seed", type=T.SEED, default=0, help="seed of the input family (default 0)")


def run(a) -> int:
    return main(quick=a.quick, batches=a.batches, out=a.out, execution=a.execution, seed=a.seed)
