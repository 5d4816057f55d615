"""``dcp-harness bench opaque``: host overhead per call of the opaque attention operator (chain compile)."""

from __future__ import annotations

from pathlib import Path

from harness import cli_types as T
from harness.bench.microbatch import opaque_main
from harness.commands.common import add_out

NAME = "opaque"
HELP = "host overhead per call of the opaque attention operator (chain compile)"
DESCRIPTION = None


def add_arguments(p) -> None:
    p.add_argument("--against", type=Path, default=None,
                   help="an older harness/runtime/opaque.py to time interleaved with this checkout's "
                        "(e.g. git show REV:harness/runtime/opaque.py > old.py)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--reps", type=T.REPEATS, default=300, help="interleaved repetitions (300)")
    add_out(p, "bench_opaque.json")


def run(a) -> int:
    return opaque_main(against=a.against, device=a.device, reps=a.reps, out=a.out)
