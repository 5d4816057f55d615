"""``dcp-harness bench attention``: CP attention forward + backward throughput on GPUs."""

from __future__ import annotations

import argparse

from harness import cli_types as T
from harness.bench.attention import main
from harness.commands.common import add_out, add_stall

NAME = "attention"
HELP = "(GPU) CP attention fwd+bwd throughput and per-GPU efficiency"
DESCRIPTION = None


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=T.WORLD, default=None, help="GPUs to use (default min(4, available))")
    add_out(p, "bench_attention.json")
    add_stall(p)
    p.add_argument("--backend", default="auto",
                   help="attention backend (auto, sdpa, flash, varlen, flash_attn, te; default auto = flash on CUDA)")
    p.add_argument("--tokens", type=_counts("tokens a pack", _PACK), default=None,
                   help="pack sizes, comma-separated (default 32768,131072; the step benchmark's CP-4 blocks: 8192)")
    p.add_argument("--sequences", type=_counts("sequences a pack", T.SEQUENCES), default=None,
                   help="equal sequences a pack, comma-separated (default 1,8)")


_PACK = T.integer(16, T.MAX_PACK_TOKENS, "a pack of CP 8 needs 16 tokens", "one pack of every rank's GPU memory")


def _counts(what: str, one):
    def parse(text: str) -> list[int]:
        items = [x for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{what}: give one or more integers, comma-separated (e.g. 8192,32768)")
        return [one(x.strip()) for x in items]
    return parse


def run(a) -> int:
    _check_gpus(a.nproc)
    cfg = {"backend": a.backend, **({"tokens": a.tokens} if a.tokens else {}),
           **({"shapes": a.sequences} if a.sequences else {})}
    return main(out=a.out, nproc=a.nproc, cfg=cfg, stall_s=a.stall_timeout)


def _check_gpus(nproc: int | None) -> None:
    """``--nproc`` GPU processes need that many visible GPUs (without CUDA the benchmark says so itself)."""
    if nproc is None:
        return
    import torch  # ~1 s to import; only an explicit --nproc needs the GPU count before the launch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found and nproc > found:
        raise T.UsageError(f"--nproc {nproc} needs {nproc} GPUs but {found} are visible; use --nproc {found} or fewer")
