"""Launch a function on every rank of a real torch.distributed world.

``run_on_ranks(fn, world_size=..., tmp_path=...)`` starts ``world_size`` processes (``forkserver`` start
method: a server process imports torch once and forks every rank from it, so a world starts in ~0.1 s
instead of a few seconds of imports per rank; each rank gets the caller's environment as it is at the
call, as ``spawn`` would give it), joins them into one gloo (or nccl) group through a ``file://`` store inside ``tmp_path``
(no ports, so it is safe under pytest-xdist), calls ``fn(rank, world_size, *args, **kwargs)`` on each
and returns the ranks' return values. Collectives time out after ``timeout_s``.

When a rank fails, every rank's traceback is kept (``rank<N>.traceback`` in the world's folder) and
one ``RankFailure`` reports the *first real* error: a rank's own exception, or a rank that died
without one (``os._exit``, a signal), rather than the "connection reset by peer" or timeout its
partners see afterwards. A dead rank makes its partners fail within ``timeout_s``; ranks still alive
after that are killed, so nothing hangs.

The first world of a process starts the server (~1 s); later worlds reuse it.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import pickle
import re
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

from harness.jobs import zygote

PEER_PATTERNS = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|Timed out|[Tt]imeout|timed out|"
    r"NCCL communicator was aborted|ProcessGroup.*(aborted|shutdown)|Socket Timeout|Connection refused|"
    r"Application timeout caused pair closure|read or write failed|EOF",
)


@dataclass(frozen=True)
class RankReport:
    rank: int
    exitcode: int | None
    traceback: str | None
    when: float  # time the failure was recorded (traceback written or exit observed)

    @property
    def peer_error(self) -> bool:
        return self.traceback is not None and bool(PEER_PATTERNS.search(self.traceback.strip().splitlines()[-1]))


class RankFailure(RuntimeError):
    """A rank of a ``run_on_ranks`` world failed. ``rank`` is the first real failure; ``reports``
    holds every rank's exit code and traceback."""

    def __init__(self, rank: int, reports: list[RankReport], world_dir: Path):
        self.rank, self.reports, self.world_dir = rank, reports, world_dir
        first = reports[rank]
        if first.traceback:
            what = first.traceback.rstrip()
        elif first.exitcode is None:
            what = "still running at the deadline (killed)"
        else:
            what = f"died with exit code {first.exitcode} without a Python traceback"
        others = ", ".join(f"rank {r.rank}: {_last_line(r)}" for r in reports if r.rank != rank and _failed(r))
        super().__init__(f"rank {rank} failed first: {what}"
                         + (f"\n(afterwards {others})" if others else "") + f"\n(tracebacks in {world_dir})")


def _failed(r: RankReport) -> bool:
    return r.exitcode != 0


def _last_line(r: RankReport) -> str:
    if r.traceback:
        return r.traceback.strip().splitlines()[-1][:200]
    return "killed at the deadline" if r.exitcode is None else f"exit code {r.exitcode}"


PRELOAD = [*zygote.PRELOAD, "harness.jobs.launch"]
"""What the fork server imports before it forks any rank (nothing that starts threads or CUDA): the zygote's
preloads (torch, and ``torch._dynamo`` and AOT autograd, which ranks import as they run: ~2 s a rank), and this
module."""


def _worker(fn, rank: int, world_size: int, world_dir: str, backend: str, timeout_s: float, args, kwargs,
            env: dict):
    os.environ.clear()  # the caller's environment at the call, not the fork server's at its start
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(world_dir)
    try:
        dist.init_process_group(backend, init_method=f"file://{out / 'store'}", rank=rank,
                                world_size=world_size, timeout=dt.timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args, **kwargs)
        tmp = out / f".result{rank}.tmp"
        tmp.write_bytes(pickle.dumps(result))
        os.replace(tmp, out / f"result{rank}.pkl")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        (out / f"rank{rank}.traceback").write_text(f"{time.time()}\n{traceback.format_exc()}")
        os._exit(1)  # never hang in process-group teardown
    os._exit(0)


def run_on_ranks(fn, *, world_size: int, tmp_path, args: tuple = (), kwargs: dict | None = None,
                 timeout_s: float = 60.0, backend: str = "gloo", start_timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked ranks; return their
    results in rank order or raise ``RankFailure``. ``fn`` must be importable (a module-level
    function) and its arguments and result picklable."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    world_dir = Path(tmp_path) / f"world-{uuid.uuid4().hex[:8]}"
    world_dir.mkdir(parents=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, name=f"rank{r}",
                         args=(fn, r, world_size, str(world_dir), backend, timeout_s, args, kwargs or {}, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    exit_seen: dict[int, float] = {}
    deadline = time.monotonic() + start_timeout_s + timeout_s
    first_failure = None
    while len(exit_seen) < world_size:
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r not in exit_seen and not p.is_alive():
                exit_seen[r] = time.time()
                if p.exitcode != 0 and first_failure is None:
                    first_failure = now
        grace_over = first_failure is not None and now > first_failure + timeout_s + 5.0
        if now > deadline or grace_over:
            break
        time.sleep(0.02)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    reports = [_report(r, p, world_dir, exit_seen.get(r)) for r, p in enumerate(procs)]
    if all(rep.exitcode == 0 for rep in reports):
        return [pickle.loads((world_dir / f"result{r}.pkl").read_bytes()) for r in range(world_size)]
    raise RankFailure(_first_real(reports), reports, world_dir)


def _report(rank: int, p, world_dir: Path, exit_time: float | None) -> RankReport:
    tb_file = world_dir / f"rank{rank}.traceback"
    if tb_file.exists():
        stamp, _, text = tb_file.read_text().partition("\n")
        return RankReport(rank, p.exitcode if exit_time else None, text, float(stamp))
    return RankReport(rank, p.exitcode if exit_time else None, None, exit_time or float("inf"))


def _first_real(reports: list[RankReport]) -> int:
    """Own exceptions first (earliest), then ranks that died without a traceback, then ranks still
    running at the deadline (hung: their partners only saw timeouts), then the rest."""
    failed = [r for r in reports if r.exitcode != 0]
    own = [r for r in failed if r.traceback and not r.peer_error]
    silent = [r for r in failed if r.traceback is None and r.exitcode is not None]
    hung = [r for r in failed if r.traceback is None and r.exitcode is None]
    for group in (own, silent, hung, failed):
        if group:
            return min(group, key=lambda r: (r.when, r.rank)).rank
    return 0
