"""``dcp-harness nightly``: every model, more steps, GPUs when present; the history and its trend plots."""

from __future__ import annotations

from pathlib import Path

from harness import cli_types as T
from harness.apps.nightly import NIGHTLY, NIGHTLY_MODELS
from harness.apps.nightly import run as run_nightly
from harness.commands.common import add_stall, names
from harness.runtime.model_config import MODELS

NAME = "nightly"
HELP = "every model, more steps, GPUs when present; history with trend plots"
DESCRIPTION = ("The nightly convergence job: exit 0 when every case passed, 1 when one failed or was not exercised "
               "(dynamic CP never formed a CP group > 1), 2 for a usage error.")


def add_arguments(n) -> None:
    n.add_argument("--steps", type=T.STEPS, default=100)
    n.add_argument("--models", default=",".join(NIGHTLY_MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    n.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                   help="auto: the distributed cases on GPUs when there are >= 2, else on 4 CPU ranks (and the "
                        "single-GPU numerics on a lone GPU)")
    n.add_argument("--world", type=T.WORLD, default=None, help="ranks of the distributed cases (>= 2; default: min(4, "
                                                           "GPUs) on GPUs, 4 on CPU)")
    n.add_argument("--only", default="", metavar="PART[,PART]",
                   help="run only the cases whose id contains one of these parts, e.g. w4_pp2 or tiny_moe__w4__ (rerun "
                        "one case, or split the nightly over several jobs into one --root)")
    n.add_argument("--root", type=Path, default=None, help="default reports/nightly")
    n.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the run's summary as JSON")
    add_stall(n)


def run(a) -> int:
    if a.world is not None and _cpu_ranks(a.device):
        T.check_cpu_ranks(a.world, "--world")
    return run_nightly(steps=a.steps, models=names(a.models) or (), device=a.device, world=a.world,
                       root=a.root or NIGHTLY, stall_s=a.stall_timeout, json_path=a.json, select=names(a.only) or ())


def _cpu_ranks(device: str) -> bool:
    """Whether ``nightly --device`` runs its distributed cases on CPU ranks (auto: fewer than 2 GPUs)."""
    if device != "auto":
        return device == "cpu"
    import torch  # ~1 s to import; only --device auto with --world asks it for the GPUs

    return not torch.cuda.is_available() or torch.cuda.device_count() < 2
