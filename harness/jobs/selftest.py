"""``selftest``: a torchrun job that exercises the launcher's bounds (``harness.jobs.launcher``).

Every rank all-reduces a counter for ``steps`` steps, reporting each step to its heartbeat. The
config can make one rank fail at one step in the ways real jobs fail: ``"raise"`` (a Python
exception), ``"kill"`` (SIGKILL: no traceback), ``"stop"`` (SIGSTOP: the process stays, its partners
wait in the next collective). ``suites/dist_cpu/test_launch_bounds.py`` checks that each ends the job
quickly with one line naming that rank.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from harness.heartbeat import Heartbeat


def job(rank: int, world: int, cfg: dict) -> dict:
    heartbeat = Heartbeat.from_cfg(cfg, rank)
    fail_rank, fail_step, how = cfg.get("fail_rank"), cfg.get("fail_step"), cfg.get("how")
    total = torch.zeros(1)
    for step in range(1, int(cfg.get("steps", 5)) + 1):
        heartbeat.beat(force=True, step=step, of=cfg.get("steps", 5))
        if rank == fail_rank and step == fail_step:
            if how == "raise":
                raise RuntimeError(f"selftest failure on rank {rank} at step {step}")
            os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[how])
        t = torch.ones(1)
        dist.all_reduce(t)
        total += t
        time.sleep(float(cfg.get("step_s", 0.05)))
    # the string hash: one seed for every rank the zygote forked, a seed of its own for a fresh process
    return {"rank": rank, "total": float(total), "comm": _process_name(), "hash": hash("dcp-harness")}


def _process_name() -> str | None:
    """This process's name (``/proc/self/comm``): ``dcp-rank<N>`` for a rank the zygote forked."""
    try:
        return Path("/proc/self/comm").read_text().strip()
    except OSError:
        return None
