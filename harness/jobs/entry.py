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
from harness.jobs.watchdog import PEER_ERRORS, JobFailure, describe_peer, die_with_parent
from harness.plan.errors import PlanInputError

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
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_rank(a.job, a.out, json.loads(a.cfg), rank, world, int(os.environ.get("LOCAL_RANK", rank)))
    return 0


def run_rank(job: str, out, job_cfg: dict, rank: int, world: int, local_rank: int) -> None:
    """One rank of ``job``: form the process group (NCCL on CUDA, gloo otherwise), run the job, gather every rank's
    result; rank 0 writes them to ``out`` (JSON, atomically)."""
    import torch  # lazy: the launcher side imports this module without torch
    import torch.distributed as dist

    heartbeat = Heartbeat.from_cfg(job_cfg, rank)
    heartbeat.beat(force=True, phase="starting")
    watch = None
    try:
        # a job config may pin the device ("cpu": gloo even where GPUs are present)
        cuda = torch.cuda.is_available() and job_cfg.get("device", "cuda") == "cuda"
        if cuda:
            torch.cuda.set_device(local_rank)
        timeout = dt.timedelta(seconds=float(job_cfg.get("collective_timeout_s", 600)))
        if job_cfg.get("nnodes", 1) > 1:  # every node runs as many processes (before the group waits for them)
            peers.check_nodes_agree(job_cfg["nnodes"], float(job_cfg.get("rdzv_timeout_s", 300)))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, rank=rank, world_size=world)
        watch = _peer_watch(job, job_cfg, rank, world, heartbeat)
        cfg = {**job_cfg, "device": "cuda" if cuda else "cpu"}
        with _around(cfg.get("around")):
            result = _job(job)(rank, world, cfg)
        heartbeat.beat(force=True, phase="gathering results")
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            atomic_write_json(out, {"job": job, "world": world, "cfg": cfg, "ranks": gathered},
                              strict=False)  # the launcher reads it back: a NaN loss stays NaN
        dist.barrier()
        if watch is not None:
            watch.stop()
    except BaseException as e:
        heartbeat.failed()
        if watch is not None and PEER_ERRORS.search(str(e)):  # a partner went away: name its node, not this rank
            watch.diagnose()
        raise
    dist.destroy_process_group()


def _peer_watch(job: str, cfg: dict, rank: int, world: int, heartbeat):
    """Each rank watches the other nodes' ranks (``harness.jobs.peers``): in a multi-node job the harness launched
    (the note goes to this node's launcher), or as a rank of a several-node world the user's launcher started (the
    rank prints the line and leaves: nothing of the harness watches it from outside)."""
    stall = float(cfg.get("stall_s", 180))
    if cfg.get("nnodes", 1) > 1:
        return peers.PeerWatch(rank, world, int(os.environ["LOCAL_WORLD_SIZE"]), stall, heartbeat).start()
    local = int(cfg.get("launched_local_world", world))
    if local >= world:
        return None

    def leave(note: dict) -> None:
        print(f"dcp-harness: error: {job}: {describe_peer({'rank': rank, **note})}", file=sys.stderr, flush=True)
        os._exit(3)

    return peers.PeerWatch(rank, world, local, stall, heartbeat, on_peer=leave).start()


class JobConfigError(PlanInputError):
    """A job's bound (``stall_s``, ``timeout_s``) that no job can run under."""


class LaunchedWorldError(PlanInputError):
    """The world a user's launcher started does not match what the command asks for, or lacks what it needs."""


def launched_world() -> tuple[int, int, int, int] | None:
    """(rank, world, local rank, local world) when a launcher the user ran started this process as one rank of a
    world - torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) or Slurm's ``srun`` with two or
    more tasks (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``;
    ``MASTER_ADDR`` and ``MASTER_PORT`` exported by the batch script) - else None (a plain command: the harness
    starts the ranks itself)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        return rank, world, local, int(env.get("LOCAL_WORLD_SIZE", world))
    if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) >= 2:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE", str(world)).split("(")[0].split(",")[0]
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise LaunchedWorldError(f"srun started this process as task {rank} of {world}, but {' and '.join(missing)} "
                                     "is not set: export MASTER_ADDR (the first node's host name) and MASTER_PORT (a "
                                     "free port) in the batch script (docs/slurm.sbatch)")
        return rank, world, int(env.get("SLURM_LOCALID", 0)), int(per_node)
    return None


def local_ranks(default: int) -> int:
    """The ranks this machine runs: the launcher's local world when one started this process, else ``default``."""
    here = launched_world()
    return here[3] if here is not None else default


def _run_in_place(job: str, out: Path, cfg: dict, here, stall: float) -> dict | None:
    rank, world, local, local_world = here
    cfg = {**cfg, "collective_timeout_s": cfg.get("collective_timeout_s", 2 * stall), "stall_s": stall,
           "launched_local_world": local_world}
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun and the harness's own launcher run ranks (srun does not)
        import torch  # lazy: the launcher side imports this module without torch

        torch.set_num_threads(1)
    try:
        run_rank(job, out, cfg, rank, world, local)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        raise JobFailure(f"{job}: rank {rank} of the {world} ranks its launcher started: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:400]}", rank) from e
    return json.loads(Path(out).read_text()) if rank == 0 else None


def launch(job: str, nproc: int, out: Path, cfg: dict | None = None, timeout_s: float = 1800, stream=None,
           stall_s: float | None = None, log: Path | None = None, nodes: Nodes | None = None) -> dict | None:
    """Run ``job`` under torchrun on ``nproc`` local processes and return rank 0's JSON. ``stream``:
    called with each output line as it arrives (progress). Bounded: the job fails with ``JobFailure``
    when no rank reports progress for ``stall_s`` seconds (default ``DEFAULT_STALL_S`` of the job's
    device; the collectives time out at twice that), when it runs past ``timeout_s``, or when a rank
    fails; the exception names the rank that failed first and why in one line, and the job's whole
    output is kept in ``log`` (default: next to ``out``; deleted after a success). An interrupted job
    (Ctrl-C, or ``Terminated`` by SIGTERM / SIGHUP) keeps its output so far there too: the
    ``KeyboardInterrupt`` carries the path as ``log`` for the message that reports it.

    ``nodes``: this machine of a multi-node job (``harness.jobs.nodes``); the result is None on every node but
    node 0. Started by a launcher of the user's (``torchrun ... -m harness ...``, ``srun dcp-harness ...``:
    ``launched_world``), this process is one rank of the job and runs it in place (rank 0 gets the result, the
    others None; bounded by the collectives' timeout, twice ``stall_s``), and a one-rank side job (a reference)
    runs on rank 0 alone under a torchrun of its own."""
    cfg = dict(cfg or {})
    for name, v in (("stall_s", stall_s), ("timeout_s", timeout_s)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise JobConfigError(f"launch({name}={v!r}): give a finite number of seconds > 0 (or None: the "
                                 f"default {name})")
    on_cpu = cfg.get("device", "cuda") != "cuda" or not _has_cuda()
    stall = float(stall_s if stall_s is not None else DEFAULT_STALL_S["cpu" if on_cpu else "cuda"])
    here = launched_world()
    if here is not None:
        want = nproc * (nodes.nnodes if nodes else 1)
        if want == here[1]:
            return _run_in_place(job, Path(out), cfg, here, stall)
        if want != 1:
            raise LaunchedWorldError(f"this process is rank {here[0]} of {here[1]} ranks its launcher started, the "
                                     f"command asks for {want}: give --world {here[1]} (and no --nnodes: the "
                                     "launcher placed the ranks)")
        if here[0] != 0:  # a one-rank side job runs on rank 0 alone
            return None
    log = Path(log) if log else Path(out).with_name(f"torchrun-{job}.log")
    try:
        return launcher.run(job, nproc, Path(out), cfg, timeout_s=timeout_s, stall_s=stall, stream=stream, log=log,
                            target=target_of(job), nodes=nodes, fork_ranks=on_cpu)
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
