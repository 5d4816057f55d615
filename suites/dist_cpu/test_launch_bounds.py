"""torchrun jobs are bounded: a rank that raises, dies or stops ends the job within seconds with one
``JobFailure`` naming that rank, the job's whole output stays in a log file, and no process of the job
outlives it (a stopped rank included)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from harness.jobs import zygote
from harness.jobs.entry import launch
from harness.jobs.watchdog import JobFailure

pytestmark = pytest.mark.dist_cpu


def _launch(tmp_path, **cfg):
    return launch("selftest", 4, tmp_path / "out.json", {"device": "cpu", "steps": 6, **cfg}, stall_s=6,
                  log=tmp_path / "logs" / "selftest.log")


def _processes_of(tmp_path) -> list[int]:
    """Live processes whose command line names ``tmp_path`` (torchrun and the ranks of a job there)."""
    mine = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if str(tmp_path).encode() in cmd and state not in "ZX":
                mine.append(int(d.name))
    return mine


def test_a_healthy_job_returns_and_leaves_no_log(tmp_path):
    res = _launch(tmp_path)
    assert [r["total"] for r in res["ranks"]] == [24.0] * 4
    assert not (tmp_path / "logs" / "selftest.log").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no heartbeat folder, no empty log folder


@pytest.mark.parametrize("how, expect, limit_s", [
    ("raise", r"rank 2 failed first: raised RuntimeError: selftest failure on rank 2 at step 3", 30),
    ("kill", r"rank 2 failed first: was killed by signal 9 without a Python traceback", 30),
    ("stop", r"rank 2 made no progress for \d+ s \(its process is stopped, e\.g\. by SIGSTOP\); its last report: "
             r"step 3 of 6", 40),
])
def test_a_failing_rank_ends_the_job_with_one_line_naming_it(tmp_path, how, expect, limit_s):
    t = time.monotonic()
    with pytest.raises(JobFailure, match=expect) as info:
        _launch(tmp_path, fail_rank=2, fail_step=3, how=how)
    assert time.monotonic() - t < limit_s
    e = info.value
    assert e.rank == 2 and e.log.exists() and "\n" not in str(e)
    assert str(e).endswith(f"; output: {e.log}")
    left = _processes_of(tmp_path) + zygote.forked_alive()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} outlived the failed job"


def test_the_watchdog_names_the_stopped_rank_and_waits_for_startup(tmp_path):
    """Unit level, no processes: before every rank reported, the start-up limit applies; then the
    stopped process is blamed before ranks that only wait in a collective."""
    import os
    import signal
    import subprocess
    import sys

    from harness.heartbeat import Heartbeat
    from harness.jobs.watchdog import STARTUP_S, stalled

    t0 = time.time()
    Heartbeat(tmp_path, 0).beat(force=True, step=5, of=9)
    assert stalled(tmp_path, 2, t0, stall_s=1, now=t0 + 10) is None  # rank 1 has not reported: start-up
    assert stalled(tmp_path, 2, t0, stall_s=1, now=t0 + STARTUP_S + 1)[0] == 1
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "rank1.json").write_text(f'{{"rank": 1, "pid": {sleeper.pid}, "time": {t0 - 5}, "step": 4}}')
        os.kill(sleeper.pid, signal.SIGSTOP)
        time.sleep(0.2)
        rank, msg = stalled(tmp_path, 2, t0, stall_s=1, now=time.time() + 2)
        assert rank == 1 and "its process is stopped" in msg and "its last report: step 4" in msg
    finally:
        sleeper.kill()


@pytest.mark.parametrize("bound", [{"stall_s": -1}, {"stall_s": 0}, {"stall_s": float("nan")}, {"timeout_s": 0},
                                   {"timeout_s": float("inf")}, {"stall_s": True}, {"stall_s": "60"}])
def test_a_bound_no_job_can_run_under_is_refused_before_anything_starts(tmp_path, bound):
    """The library refuses what the command line refuses (``harness.cli_types``): a stall or timeout bound that is
    not a finite number of seconds > 0, naming the value, before any process starts."""
    from harness.jobs.entry import JobConfigError

    name, value = next(iter(bound.items()))
    with pytest.raises(JobConfigError, match=re.escape(f"launch({name}={value!r})")):
        launch("selftest", 2, tmp_path / "out.json", {"device": "cpu", "steps": 1}, **bound)
    assert not (tmp_path / "out.json").exists()


def test_warnings_go_to_the_log_and_the_progress_after_them_still_shows():
    """torch's and torchrun's warning lines are not relayed, and do not silence what follows (they once did: after
    any warning a run showed no more progress); a traceback still ends the relayed output."""
    from harness.jobs.launcher import relay

    out = ["[bshd] step    1/100  loss 5.553713",
           "[rank0]:[W1127 16:41:02.242834319 ProcessGroupNCCL.cpp:5188] Guessing device ID based on global rank. "
           "This can cause a hang if rank to GPU mapping is heterogeneous.",
           "W1127 16:41:02.287000 951 torch/distributed/run.py:851] *****",
           "[bshd] step    2/100  loss 5.499462",
           "[rank1]: Traceback (most recent call last):",
           "[dcp ] step    1/100  loss 5.553713"]
    shown, quiet = [], False
    for line in out:
        if not quiet:
            quiet = relay(line + "\n", shown.append)
    assert shown == ["[bshd] step    1/100  loss 5.553713", "[bshd] step    2/100  loss 5.499462"]
    assert quiet


def test_the_first_error_is_found_whatever_the_ranks_numbers(tmp_path):
    """Nodes that started different numbers of processes number their ranks otherwise than ``first`` says (node 1 of
    a 2 + 4 start holds ranks 2-5, not 4-7): the rank that raised is still the one named, not a rank torchrun
    stopped."""
    from harness.jobs.watchdog import first_failure

    (tmp_path / "rank3.error").write_text("20.0\nTraceback ...\nNodeMismatchError: node 1 runs 4 processes")
    (tmp_path / "rank2.error").write_text("10.0\nTraceback ...\nNodeMismatchError: node 1 runs 4 processes, node 0 runs 2")
    rank, why = first_failure(tmp_path, 4, {}, {2: 1, 3: 1, 4: -15, 5: -15}, None, first=4)
    assert rank == 2 and why == "raised NodeMismatchError: node 1 runs 4 processes, node 0 runs 2"


def test_output_that_comes_after_the_log_closed_is_relayed_without_a_traceback(tmp_path):
    """A launcher that leaves on a signal kills the job, waits a bounded time for its output, and closes the log;
    lines torchrun's dying processes print after that are still relayed, never written to the closed file (that
    write's traceback, printed by the output thread, once came out under the CLI's one-line message)."""
    import io
    import queue

    from harness.jobs import launcher

    log = open(tmp_path / "job.log", "w")  # noqa: SIM115 - closed below, as the leaving launcher closes it
    log.write("before the kill\n")
    log.close()
    lines: queue.Queue = queue.Queue()
    launcher._pump(io.StringIO("late 1\nlate 2\n"), lines, log)
    assert [lines.get_nowait() for _ in range(3)] == ["late 1\n", "late 2\n", None]
    assert (tmp_path / "job.log").read_text() == "before the kill\n"
