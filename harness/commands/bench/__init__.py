"""``dcp-harness bench ...``: the benchmarks, one module per subcommand; each writes ``reports/<name>.json``."""

from __future__ import annotations

from harness.commands.bench import attention, compare, curve, fit, microbatch, opaque, rejudge, replay, schedule, step
from harness.commands.bench import loss as loss_bench
from harness.commands.bench.simple import padding, thd
from harness.commands.common import register
from harness.io import writable

NAME = "bench"
HELP = "benchmarks (write reports/<name>.json)"
DESCRIPTION = None
SUBCOMMANDS = {c.NAME: c for c in (schedule, attention, step, curve, compare, rejudge, replay, fit, microbatch, opaque, loss_bench,
                                    padding, thd)}


def add_arguments(b) -> None:
    register(b.add_subparsers(dest="bench", required=True), SUBCOMMANDS.values())


def run(a) -> int:
    for path in (a.out, getattr(a, "html", None)):
        if path is not None:
            writable(path)  # before the benchmark runs, not after
    return SUBCOMMANDS[a.bench].run(a)
