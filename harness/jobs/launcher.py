"""Run a torchrun job as a child process and keep it bounded (``harness.jobs.entry.launch`` calls this).

torchrun runs in its own session; a thread copies its output to the log file and to ``stream``; the
main loop polls every ``POLL_S``: a rank process that vanished (seen through its heartbeat's pid), the
watchdog (``harness.jobs.watchdog.stalled``), the overall deadline. On a stall or the deadline the whole
process group is killed. torchrun starts every rank in a session of its own, so killing torchrun's group
does not reach them: the rank processes (children of torchrun, and every pid a heartbeat named) are
killed one by one, on every way out of ``run``, so that no stopped or blocked rank outlives the job.
Any failure raises one ``JobFailure`` naming the rank that failed first.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness.jobs import zygote
from harness.jobs.nodes import Nodes
from harness.jobs.watchdog import (
    JobFailure,
    Terminated,
    die_with_parent,
    first_failure,
    peer_failure,
    process_state,
    read_beats,
    stalled,
)

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE")
"""What a launcher tells its ranks: a job the harness starts itself (a side job of one rank, under its own torchrun)
must not inherit it."""

POLL_S = 0.25
FAILURE_OUTPUT = re.compile(r"^(Traceback \(most recent call last\)|\[rank\d+\]:|E\d{4} )|"
                            r"torch\.distributed\.elastic|ChildFailedError")
"""Output that starts a failure report (tracebacks, torchrun's summary): from there on the output only
goes to the log, so the user sees one error line, not pages of every rank's traceback."""
WARNING_OUTPUT = re.compile(r"^(\[rank\d+\]:)?(\[W\d{4} |W\d{4} )")
"""torch's and torchrun's warning lines (``[W1127 16:41:02.1 ProcessGroupNCCL.cpp:5188] ...``, ``W1127 ...
torch/distributed/run.py:...``, with or without the ``[rankN]:`` prefix): to the log only. They do not start a
failure report: treating them as one silenced the rest of a run after any warning (a pipelined NCCL run on 4 GPUs
showed no layout progress lines with that rule, and every line without it)."""


def relay(line: str, stream) -> bool:
    """Pass one output line to ``stream`` unless it is a warning or starts a failure report; returns whether it
    started one (the caller then relays nothing more)."""
    if WARNING_OUTPUT.search(line):
        return False
    if FAILURE_OUTPUT.search(line):
        return True
    stream(line.rstrip("\n"))
    return False
EXIT_RE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
ROOT_RE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)", re.S)


def _command(job: str, nproc: int, out: Path, cfg: dict, nodes: Nodes, zygote_at: str | None = None) -> list[str]:
    """torchrun's command line; with a zygote (``harness.jobs.zygote``) torchrun's agent and every rank are forked
    from it, each behind a client process that stands where the fresh process would."""
    argv = [job, "--out", str(out), "--cfg", json.dumps(cfg)]
    if not zygote_at:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *nodes.torchrun_args(),
                "-m", "harness.jobs.entry", *argv]
    agent = [f"--nproc-per-node={nproc}", *nodes.torchrun_args(), *zygote.command(zygote_at, "harness.jobs.entry", argv)]
    return [sys.executable, "-u", *zygote.command(zygote_at, "torch.distributed.run", agent)]


def _env() -> dict:
    """The torchrun's environment: the caller's, without what a launcher of the caller's own told it (a side job
    started from rank 0 of a user-launched world is a world of its own)."""
    root = str(Path(__file__).resolve().parents[2])
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("SLURM_")}
    return {**inherited, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def share_zygote() -> str | None:
    """One zygote for the CPU jobs this process and the processes it starts from now on launch
    (``harness.jobs.zygote.share``: a test session or a script that runs many ``dcp-harness`` jobs); its socket,
    or None when ranks run as fresh processes."""
    return zygote.share(_env())


def _pump(stdout, lines: queue.Queue, log_file) -> None:
    """Copy torchrun's output into the log and hand each line to the watcher. A launcher that is leaving (its job
    killed on a signal) closes the log after a bounded wait for this thread; lines that come after that are still
    relayed, not written (a write to the closed file would print this thread's traceback under the CLI's one line)."""
    for line in stdout:
        try:
            log_file.write(line)
            log_file.flush()
        except ValueError:  # the log was closed: the launcher is leaving
            pass
        lines.put(line)
    lines.put(None)


def _children(pid: int) -> set[int]:
    """Pids whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _is_rank(pid: int) -> bool:
    """A rank of a job: ``harness.jobs.entry`` (a fresh process, or the zygote's client), or a rank the zygote
    forked (its command line is the zygote's)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        return b"harness.jobs.entry" in cmd or b"harness.jobs.zygote" in cmd
    except OSError:
        return False


def _kill(proc, beats: Path) -> None:
    """SIGKILL torchrun's group and every rank process (SIGKILL also ends a stopped process)."""
    ranks = _children(proc.pid) | {b.get("pid") for b in read_beats(beats).values() if b.get("pid")}
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in ranks:
        if _is_rank(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _reap_ranks(beats: Path) -> None:
    """After torchrun is gone: kill any rank it left behind (a stopped rank is not reaped by torchrun)."""
    for b in read_beats(beats).values():
        pid = b.get("pid")
        if pid and process_state(pid) != "gone" and _is_rank(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _terminate_raises():
    """SIGTERM / SIGHUP raise ``Terminated`` while the job runs (Python's default would end the process
    without the clean-up that kills the ranks); main thread only, the previous handlers restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated(f"signal {signal.Signals(signum).name}")

    old = {s: signal.signal(s, raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run(job: str, nproc: int, out: Path, cfg: dict, *, timeout_s: float, stall_s: float, stream, log: Path,
        target: str | None = None, nodes: Nodes | None = None, fork_ranks: bool = False) -> dict | None:
    """Run the job on this node's ``nproc`` processes; rank 0's JSON, or None on a node other than node 0 of a
    multi-node job (node 0 holds rank 0, which writes the results). ``fork_ranks``: a CPU job, whose ranks the
    zygote may fork (``harness.jobs.zygote``)."""
    nodes = nodes or Nodes()
    first = nodes.first_rank(nproc)
    beats = Path(tempfile.mkdtemp(prefix=f".{job}-ranks-", dir=out.parent))
    cfg = {**cfg, "heartbeat_dir": str(beats), "collective_timeout_s": cfg.get("collective_timeout_s", 2 * stall_s)}
    if nodes.multi:
        cfg = {**cfg, "nnodes": nodes.nnodes, "stall_s": stall_s, "rdzv_timeout_s": nodes.rdzv_timeout_s}
    where = f" ({nodes.describe()})" if nodes.multi else ""
    log.parent.mkdir(parents=True, exist_ok=True)
    lines: queue.Queue = queue.Queue()
    started, gone_at = time.time(), {}
    try:
        env = _env()
        zygote_at = zygote.address(env) if fork_ranks else None
        with open(log, "w") as log_file:
            proc = subprocess.Popen(_command(target or job, nproc, out, cfg, nodes, zygote_at), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT,
                                    text=True, env=env, bufsize=1, start_new_session=True,
                                    preexec_fn=die_with_parent)
            pump = threading.Thread(target=_pump, args=(proc.stdout, lines, log_file), daemon=True)
            pump.start()
            try:
                with _terminate_raises():
                    failure = _watch(proc, lines, stream, beats, nproc, started, timeout_s, stall_s, gone_at,
                                     first, nodes)
            except BaseException:
                _kill(proc, beats)
                pump.join(5)  # the output up to the kill reaches the log before it is closed
                raise
            pump.join(10)
        if failure is not None:
            raise JobFailure(f"torchrun {job} on {nproc} processes{where}: {failure[1]}", failure[0], log)
        if proc.returncode != 0:
            peer = peer_failure(beats)
            if peer is not None:
                raise JobFailure(f"torchrun {job} on {nproc} processes{where}: {peer[1]}", peer[0], log)
            text = log.read_text(errors="replace")
            codes = {int(r): int(c) for r, c in EXIT_RE.findall(text)}
            root = ROOT_RE.search(text)
            rank, why = first_failure(beats, nproc, gone_at, codes, int(root.group(1)) if root else None, first)
            who = f"rank {rank} failed first: {why}" if rank is not None else why
            raise JobFailure(f"torchrun {job} on {nproc} processes{where} (exit {proc.returncode}): {who}", rank, log)
        log.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            log.parent.rmdir()  # only when empty: logs of earlier failures stay
        return json.loads(out.read_text()) if nodes.reports_here else None
    finally:
        _reap_ranks(beats)
        shutil.rmtree(beats, ignore_errors=True)


def _watch(proc, lines, stream, beats, nproc, started, timeout_s, stall_s, gone_at, first=0, nodes=None):
    """Relay output until torchrun exits; returns (rank, message) for a stall, a rank another node lost, a
    rendezvous that never completed, or the deadline."""
    nodes = nodes or Nodes()
    done, next_check, quiet = False, 0.0, False
    while True:
        try:
            line = lines.get(timeout=POLL_S)
            if line is None:
                done = True
            elif stream and not quiet:
                quiet = relay(line, stream)
        except queue.Empty:
            pass
        now = time.time()
        if now < next_check and not done:
            continue
        next_check = now + POLL_S
        for r, b in read_beats(beats).items():
            if r not in gone_at and process_state(b.get("pid")) == "gone":
                gone_at[r] = now
        if done and proc.poll() is not None:
            return None
        peer = peer_failure(beats) if nodes.multi else None
        if peer is not None:
            _kill(proc, beats)
            return peer
        if nodes.multi and not read_beats(beats) and now - started > nodes.rdzv_timeout_s:
            _kill(proc, beats)
            return None, (f"the {nodes.nnodes} nodes did not meet at {nodes.endpoint} within {nodes.rdzv_timeout_s:.0f} "
                          f"s: no rank of node {nodes.node_rank} started (start every node with --nnodes "
                          f"{nodes.nnodes}, its own --node-rank and this --rdzv-endpoint)")
        stall = stalled(beats, nproc, started, stall_s, now, first)
        if stall is not None or now - started > timeout_s:
            _kill(proc, beats)
            return stall or (None, f"still running after the job's limit of {timeout_s:.0f} s")
