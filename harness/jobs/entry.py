"""torchrun entry point: ``torchrun --nproc-per-node N -m harness.jobs.entry JOB --out FILE [--cfg JSON]``.

Jobs (``JOBS``): ``checks`` (``harness.parallel.checks.all_checks``: groups, reroute, CP attention vs full
attention), ``converge`` (``harness.train.trainer.train``), ``replay`` (``harness.train.replay.replay_check``)
and ``selftest`` (``harness.jobs.selftest.job``: the launcher's bounds); callers register theirs
(``register``: the benchmarks' ``bench-attention`` and ``bench-step``). torchrun is handed the job's
``module:function``, so a rank needs no registry.
Every rank runs the job; rank 0 gathers the ranks' results and writes them as JSON (atomically).
NCCL on CUDA machines, gloo otherwise; ``--cfg '{"device": "cpu"}'`` keeps a job on gloo there too.
``launch(job, nproc, out, cfg)`` runs it from Python (used by the GPU suite and the benchmark CLI).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import json
import os
import re
import sys
from pathlib import Path

from harness.heartbeat import Heartbeat
from harness.io import atomic_write_json
from harness.jobs import launcher, peers
from harness.jobs.nodes import Nodes
from harness.jobs.watchdog import PEER_ERRORS, die_with_parent

JOBS = {"checks": "harness.parallel.checks:all_checks", "converge": "harness.train.trainer:train",
        "replay": "harness.train.replay:replay_check", "selftest": "harness.jobs.selftest:job"}
"""Registered jobs: name -> ``"module:function"``. The runtime's own are here; a caller above it registers its
own (``register``) in the module that launches it, so this layer names no benchmark or app."""

JOB_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def register(name: str, target: str) -> str:
    """Register job ``name`` as ``"module:function"`` (the function runs on every rank as ``fn(rank, world,
    cfg)``); returns ``name``. Registering a name again with another target is an error."""
    if not JOB_TARGET.fullmatch(target):
        raise ValueError(f"job target {target!r} must be 'module:function'")
    if JOBS.get(name, target) != target:
        raise ValueError(f"job {name!r} is registered as {JOBS[name]!r}; not re-registering it as {target!r}")
    JOBS[name] = target
    return name


def target_of(job: str) -> str:
    """The ``"module:function"`` of a registered job name (or of a target given as such)."""
    if job in JOBS:
        return JOBS[job]
    if JOB_TARGET.fullmatch(job):
        return job
    raise ValueError(f"unknown job {job!r}; registered: {', '.join(sorted(JOBS))} (or give 'module:function')")


def _job(job: str):
    module, fn = target_of(job).split(":")
    return getattr(importlib.import_module(module), fn)


def _around(spec):
    """The context a job runs in: ``cfg["around"] = ["module:function", *args]`` calls ``function(*args)`` for a
    context manager that lasts the job (the caller names it: ``converge --plant`` passes the fault
    catalogue's ``planted``, so the runtime names nothing above it). None: no context."""
    if not spec:
        return contextlib.nullcontext()
    module, fn = spec[0].split(":")
    return getattr(importlib.import_module(module), fn)(*spec[1:])


DEFAULT_STALL_S = {"cpu": 180.0, "cuda": 900.0}
"""``launch``'s default: a job fails when no rank has reported progress for this long (CPU steps take
seconds; CUDA jobs compile for minutes before their first step)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.jobs.entry")
    p.add_argument("job", help="a registered job name or 'module:function'")
    p.add_argument("--out", required=True)
    p.add_argument("--cfg", default="{}", help="JSON config for the job")
    a = p.parse_args(argv)

    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # torchrun died before the request took effect
        return 3
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job_cfg = json.loads(a.cfg)
    heartbeat = Heartbeat.from_cfg(job_cfg, rank)
    heartbeat.beat(force=True, phase="starting")
    watch = None
    try:
        # a job config may pin the device ("cpu": gloo even where GPUs are present)
        cuda = torch.cuda.is_available() and job_cfg.get("device", "cuda") == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        timeout = dt.timedelta(seconds=float(job_cfg.get("collective_timeout_s", 600)))
        if job_cfg.get("nnodes", 1) > 1:  # every node runs as many processes, and each watches the others
            peers.check_nodes_agree(job_cfg["nnodes"], float(job_cfg.get("rdzv_timeout_s", 300)))
            watch = peers.PeerWatch(rank, world, int(os.environ["LOCAL_WORLD_SIZE"]),
                                    float(job_cfg.get("stall_s", 180)), heartbeat).start()
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        cfg = {**job_cfg, "device": "cuda" if cuda else "cpu"}
        with _around(cfg.get("around")):
            result = _job(a.job)(rank, world, cfg)
        heartbeat.beat(force=True, phase="gathering results")
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            atomic_write_json(a.out, {"job": a.job, "world": world, "cfg": cfg, "ranks": gathered})
        dist.barrier()
        if watch is not None:
            watch.stop()
    except BaseException as e:
        heartbeat.failed()
        if watch is not None and PEER_ERRORS.search(str(e)):  # a partner went away: name its node, not this rank
            watch.diagnose()
        raise
    dist.destroy_process_group()
    return 0


def launch(job: str, nproc: int, out: Path, cfg: dict | None = None, timeout_s: float = 1800, stream=None,
           stall_s: float | None = None, log: Path | None = None, nodes: Nodes | None = None) -> dict | None:
    """Run ``job`` under torchrun on ``nproc`` local processes and return rank 0's JSON. ``stream``:
    called with each output line as it arrives (progress). Bounded: the job fails with ``JobFailure``
    when no rank reports progress for ``stall_s`` seconds (default ``DEFAULT_STALL_S`` of the job's
    device; the collectives time out at twice that), when it runs past ``timeout_s``, or when a rank
    fails; the exception names the rank that failed first and why in one line, and the job's whole
    output is kept in ``log`` (default: next to ``out``; deleted after a success). An interrupted job
    (Ctrl-C, or ``Terminated`` by SIGTERM / SIGHUP) keeps its output so far there too: the
    ``KeyboardInterrupt`` carries the path as ``log`` for the message that reports it."""
    cfg = dict(cfg or {})
    stall = float(stall_s or DEFAULT_STALL_S["cuda" if cfg.get("device", "cuda") == "cuda" and _has_cuda() else "cpu"])
    log = Path(log) if log else Path(out).with_name(f"torchrun-{job}.log")
    try:
        return launcher.run(job, nproc, Path(out), cfg, timeout_s=timeout_s, stall_s=stall, stream=stream, log=log,
                            target=target_of(job), nodes=nodes)
    except KeyboardInterrupt as e:
        e.log = log
        raise


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    code = main()
    # A finished job (results written, every process group destroyed) leaves without interpreter
    # finalization: gloo objects torch still holds at teardown (worker threads, completed work) can abort
    # a rank there ("terminate called without an active exception"), turning a finished job into a failed
    # rank. Errors still raise above with their traceback and exit status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
