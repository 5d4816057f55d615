"""``dcp-harness bench microbatch``: host against device time of one micro-batch, per compile mode and backend."""

from __future__ import annotations

from harness import cli_types as T
from harness.bench.microbatch import MicrobatchConfig, main
from harness.commands.common import add_out, names, overrides

NAME = "microbatch"
HELP = "(GPU) host vs device time of one micro-batch's forward + backward"
DESCRIPTION = None


def add_arguments(p) -> None:
    p.add_argument("--cpu", action="store_true", help="the CPU variant (tiny-gpt, fp32, sdpa)")
    p.add_argument("--model", default=None, help="model key (default gpt-12l-h2048; tiny-gpt with --cpu)")
    p.add_argument("--shapes", type=T.shapes, default=None, help="comma list of KxL token shapes (default 1x2048,1x1024,4x512,16x128)")
    p.add_argument("--variants", default=None,
                   help="comma list of <compile>/<backend> (default off/auto,inductor/varlen,inductor/auto,"
                        "inductor-chain/auto)")
    p.add_argument("--reps", type=T.REPEATS, default=None, help="timed repetitions per shape and variant (12)")
    p.add_argument("--warmup", type=T.REPEATS0, default=None, help="untimed calls first (2)")
    add_out(p, "bench_microbatch.json")


def run(a) -> int:
    over = overrides(a, MicrobatchConfig, {"shapes": names, "variants": names})
    return main(cpu=a.cpu, out=a.out, overrides=over)
