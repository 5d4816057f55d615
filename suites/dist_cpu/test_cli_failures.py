"""A CLI job whose rank stops or dies ends within its bound with exit code 3 and one
``dcp-harness: error:`` line naming the rank and the log; the log holds the whole output, and no rank
process outlives the job (torchrun starts ranks in sessions of their own)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.jobs import zygote

pytestmark = pytest.mark.dist_cpu
SMALL = ["--batch-size", "8", "--lengths", "lognormal:mean=96,sigma=0.8,min=16,max=400", "--max-seqlen-per-rank", "128"]
"""A job whose steps take a fraction of a second: the tests wait for step 2, and the default job's bshd steps are
what the waiting cost."""


@pytest.fixture(autouse=True)
def _own_zygote(monkeypatch):
    """These tests find a job's processes among the CLI's descendants and check its own zygote's clean-up."""
    monkeypatch.delenv(zygote.SHARED, raising=False)


def _descendants(root: int) -> list[int]:
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                parent[int(d.name)] = int(stat[1])
            except (OSError, IndexError):
                pass
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def _worker(root: int, rank: int) -> int | None:
    """The process that runs ``rank``: forked by the zygote (named ``dcp-rank<N>``), else a fresh process."""
    for pid in _descendants(root):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"dcp-rank{rank}":
                return pid
        except OSError:
            continue
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"harness.jobs.entry" in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still exist as rank processes (a zombie counts as gone)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if state not in "ZX" and (b"harness.jobs.entry" in cmd or b"harness.jobs.zygote" in cmd):
            alive.append(pid)
    return alive


@pytest.mark.parametrize("sig, expect, limit_s", [
    # the stall path through the CLI also runs in the default suite as a stopped node
    # (test_multinode.py::test_a_node_that_dies_or_stops_is_named_by_the_other[stopped]); here it waits out 20 s
    pytest.param(signal.SIGSTOP, r"rank 2 made no progress for \d+ s \(its process is stopped, e\.g\. by SIGSTOP\); "
                 r"its last report: layout bshd, step \d+ of 400", 90, id="stopped", marks=pytest.mark.slow),
    pytest.param(signal.SIGKILL, r"rank 2 failed first: was killed by signal 9 without a Python traceback", 30,
                 id="killed"),
])
def test_a_rank_that_stops_or_dies_ends_converge_with_one_line(tmp_path, sig, expect, limit_s):
    proc = subprocess.Popen([sys.executable, "-m", "harness", "converge", *SMALL, "--steps", "400", "--stall-timeout",
                             "20", "--golden", "off", "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "step    2/400" in line:
                break
        ranks = [_worker(proc.pid, r) for r in range(4)]
        pid = ranks[2]
        assert pid is not None, "".join(seen)[-2000:] + (proc.stderr.read() if proc.poll() is not None else "")
        t = time.monotonic()
        os.kill(pid, sig)
        _, err = proc.communicate(timeout=limit_s + 30)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
        left = _alive([p for p in ranks if p] if "ranks" in locals() else [])
        for p in left:
            os.kill(p, signal.SIGKILL)
    assert not left, f"rank processes {left} outlived the job"
    assert proc.returncode == 3 and took < limit_s, (proc.returncode, took, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-harness: error: torchrun converge on 4 processes"), err
    assert re.search(expect, lines[0]), lines[0]
    log = Path(lines[0].rsplit("; output: ", 1)[1])
    assert log.parent == tmp_path / "logs" and "step    2/400" in log.read_text()


def _start_and_reach_step_2(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "harness", "converge", *SMALL, "--steps", "400", "--golden", "off",
                             "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "step    2/400" in line:
            break
    ranks = [p for p in (_worker(proc.pid, r) for r in range(4)) if p]
    torchrun = [p for p in _descendants(proc.pid) if b"torch.distributed.run" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(ranks) == 4 and len(torchrun) == 1, (ranks, torchrun)
    # the zygote and what it forked besides the ranks (torchrun's agent), when the ranks are forked
    forked = [p for p in _descendants(proc.pid) if b"harness.jobs.zygote" in _cmdline(p)]
    return proc, sorted(set(ranks + torchrun + forked))


def _gone_within(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if _is_process(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _is_process(p)]


def _is_process(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("sig, code, said", [
    pytest.param(signal.SIGTERM, 143, "terminated by signal SIGTERM; the job's processes were killed", id="sigterm"),
    # the same kill path as SIGTERM, another signal: the slow suite's
    pytest.param(signal.SIGINT, 130, "interrupted; the job's processes were killed", id="ctrl-c",
                 marks=pytest.mark.slow),
])
def test_an_interrupted_cli_ends_the_whole_job_and_names_its_log(tmp_path, sig, code, said):
    """A scheduler's SIGTERM (a time limit, a cancelled CI job) or Ctrl-C: one line naming the log that keeps
    the job's output so far, exit 143 / 130, no process left."""
    proc, pids = _start_and_reach_step_2(tmp_path)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        left = _gone_within(pids, 15)
    finally:
        for p in pids:
            if _is_process(p):
                os.kill(p, signal.SIGKILL)
    assert proc.returncode == code, (proc.returncode, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dcp-harness: {said}; output: "), err
    log = Path(lines[0].rsplit("; output: ", 1)[1])
    assert log.parent == tmp_path / "logs" and "step    2/400" in log.read_text()
    assert not left, f"processes {left} outlived the job"


def test_a_killed_cli_takes_torchrun_and_every_rank_with_it(tmp_path):
    """SIGKILL cannot be handled: torchrun and the ranks ask the kernel to kill them with their parent, and the
    zygote removes its socket's folder as it goes (the launcher's ``atexit`` never runs)."""
    proc, pids = _start_and_reach_step_2(tmp_path)
    sockets = {Path(_cmdline(p).split(b"\0")[-2].decode()).parent for p in pids
               if b"harness.jobs.zygote" in _cmdline(p)}
    assert sockets or not zygote.enabled(), "the CPU job's ranks were not forked by a zygote"
    try:
        proc.kill()
        proc.wait(10)
        left = _gone_within(pids, 15)
    finally:
        for p in pids:
            if _is_process(p):
                os.kill(p, signal.SIGKILL)
    assert not left, f"processes {left} outlived the killed launcher"
    assert not [d for d in sockets if d.exists()], f"zygote folders {sockets} outlived the killed launcher"
