"""``dcp-harness run``: the main job (convergence, schedulers, edge cases, faults) on the embedded CPU default."""

from __future__ import annotations

from pathlib import Path

from harness import cli_types as T
from harness.commands.common import add_stall
from harness.paths import REPORTS

NAME = "run"
HELP = "the main job on the embedded CPU default"
DESCRIPTION = None


def add_arguments(p) -> None:
    p.add_argument("--batches", type=T.BATCHES, default=3, help="global batches per configuration (default 3)")
    p.add_argument("--out", type=Path, default=None, help="report root (default reports/)")
    p.add_argument("--steps", type=T.STEPS, default=50, help="convergence steps (default 50, which has a golden)")
    p.add_argument("--no-convergence", action="store_true", help="skip every convergence comparison")
    p.add_argument("--no-faults", action="store_true", help="skip the fault catalogue (dcp-harness faults)")
    p.add_argument("--no-pipeline", action="store_true", help="skip the convergence run under pipeline parallelism")
    p.add_argument("--no-hybrid", action="store_true", help="skip the convergence run of the hybrid SSM model")
    add_stall(p)


def run(a) -> int:
    from harness.apps import main_job  # imports torch (~1 s): only this command pays for it

    conv = None if a.no_convergence else {**main_job.DEFAULT_CONVERGENCE, "steps": a.steps}
    skip = a.no_pipeline or a.no_convergence
    pipe = None if skip else {**main_job.DEFAULT_PIPELINE, "steps": a.steps}
    hybrid = None if a.no_hybrid or a.no_convergence else {**main_job.DEFAULT_HYBRID, "steps": a.steps}
    if a.out is not None:
        T.writable_folder(a.out, "--out")
    code, _ = main_job.run(quick_batches=a.batches, out_root=a.out or REPORTS, convergence=conv,
                           pipeline=pipe, hybrid=hybrid, faults=not a.no_faults, stall_s=a.stall_timeout)
    return code
