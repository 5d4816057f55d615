"""A CLI job whose rank stops or dies ends within its bound with exit code 3 and one
``dcp-harness: error:`` line naming the rank and the log; the log holds the whole output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist_cpu


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
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"harness.dist.entry" in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


@pytest.mark.parametrize("sig, expect, limit_s", [
    (signal.SIGSTOP, r"rank 2 made no progress for \d+ s \(its process is stopped, e\.g\. by SIGSTOP\); its last "
                     r"report: layout bshd, step \d+ of 400", 90),
    (signal.SIGKILL, r"rank 2 failed first: was killed by signal 9 without a Python traceback", 30),
], ids=["stopped", "killed"])
def test_a_rank_that_stops_or_dies_ends_converge_with_one_line(tmp_path, sig, expect, limit_s):
    proc = subprocess.Popen([sys.executable, "-m", "harness", "converge", "--steps", "400", "--stall-timeout", "20",
                             "--golden", "off", "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "step    2/400" in line:
                break
        pid = _worker(proc.pid, 2)
        assert pid is not None, "".join(seen)[-2000:] + (proc.stderr.read() if proc.poll() is not None else "")
        t = time.monotonic()
        os.kill(pid, sig)
        _, err = proc.communicate(timeout=limit_s + 30)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["pkill", "-9", "-P", str(proc.pid)], check=False)
    assert proc.returncode == 3 and took < limit_s, (proc.returncode, took, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-harness: error: torchrun converge on 4 processes"), err
    assert re.search(expect, lines[0]), lines[0]
    log = Path(lines[0].rsplit("; output: ", 1)[1])
    assert log.parent == tmp_path / "logs" and "step    2/400" in log.read_text()
