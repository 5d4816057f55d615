"""The rank zygote (``harness.jobs.zygote``): a client stands where a fresh rank process would, and the forked
process gets the client's command line, environment, working directory and stdio, its signals, and the exit
status it ends with; a client that loses its zygote or never reaches one leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.jobs import zygote

pytestmark = pytest.mark.dist_cpu
ROOT = Path(__file__).resolve().parents[2]
PROBE = "suites.dist_cpu.zygote_probe"


@pytest.fixture(autouse=True)
def _own_zygote(monkeypatch):
    """The launchers these tests start own their zygote, unless a test names a shared one."""
    monkeypatch.delenv(zygote.SHARED, raising=False)


def _client(at: str, mode: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PROBE": "from-the-client", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-u", *zygote.command(at, PROBE, [mode, "x y"])], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def at() -> str:
    found = zygote.address({**os.environ, "PYTHONPATH": str(ROOT)})
    assert found is not None, "the zygote did not start"
    return found


def test_the_forked_process_runs_what_the_client_was_given_and_exits_as_it_did(at):
    proc = _client(at, "exit")
    out, err = proc.communicate(timeout=60)
    seen = json.loads(out.splitlines()[0])
    assert proc.returncode == 7, err
    assert seen["argv"] == ["exit", "x y"] and seen["probe"] == "from-the-client" and seen["cwd"] == str(ROOT)
    assert seen["torch"] and seen["comm"] == "dcp-forked" and seen["pid"] != proc.pid  # forked, torch preloaded
    assert err == "to stderr\n"


def test_a_raising_rank_prints_its_traceback_and_exits_1(at):
    proc = _client(at, "raise")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "RuntimeError: probe failure" in err and "Traceback" in err


def test_an_unhandled_ctrl_c_ends_the_rank_as_it_ends_a_fresh_process(at):
    fresh = _client("/nonexistent/dcp-zygote/sock", "interrupt")
    forked = _client(at, "interrupt")
    (_, fresh_err), (_, forked_err) = fresh.communicate(timeout=60), forked.communicate(timeout=60)
    assert forked.returncode == fresh.returncode == -signal.SIGINT
    assert "KeyboardInterrupt" in forked_err and "KeyboardInterrupt" in fresh_err


def test_signals_reach_the_forked_rank_and_the_client_exits_as_it_did(at):
    proc = _client(at, "sleep")
    seen = json.loads(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 5 and out == "probe got SIGTERM\n" and _gone(seen["pid"], 5)


def test_sigterm_ends_a_rank_without_a_handler_as_it_ends_a_fresh_process_and_leaves_the_zygote_serving(at):
    """The zygote's own SIGTERM clean-up is not inherited: the rank dies of the signal, the zygote's folder stays."""
    fresh = _client("/nonexistent/dcp-zygote/sock", "idle")
    forked = _client(at, "idle")
    for proc in (fresh, forked):
        json.loads(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
    assert fresh.wait(30) == forked.wait(30) == -signal.SIGTERM
    assert Path(at).exists(), "the rank ran the zygote's clean-up"
    again = _client(at, "exit")
    again.communicate(timeout=60)
    assert again.returncode == 7


def test_a_rank_killed_by_a_signal_kills_its_client_with_the_same(at):
    proc = _client(at, "sleep")
    seen = json.loads(proc.stdout.readline())
    os.kill(seen["pid"], signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


def test_a_killed_client_takes_its_forked_rank_with_it(at):
    proc = _client(at, "sleep")
    seen = json.loads(proc.stdout.readline())
    proc.kill()
    proc.wait(30)
    assert _gone(seen["pid"], 10), f"forked rank {seen['pid']} outlived its client"


def test_without_a_zygote_the_client_is_the_rank():
    proc = _client("/nonexistent/dcp-zygote/sock", "exit")
    out, _ = proc.communicate(timeout=60)
    seen = json.loads(out.splitlines()[0])
    assert proc.returncode == 7 and seen["pid"] == proc.pid and not seen["torch"] and seen["comm"] != "dcp-forked"


def test_a_cpu_job_forks_its_ranks_and_gives_what_fresh_ranks_give(tmp_path, monkeypatch):
    from harness.jobs.entry import launch

    cfg = {"device": "cpu", "steps": 3}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # each fresh process draws its own string hash seed
    forked = launch("selftest", 4, tmp_path / "a" / "out.json", cfg, stall_s=60)
    monkeypatch.setenv(zygote.ENV, "0")
    fresh = launch("selftest", 4, tmp_path / "b" / "out.json", cfg, stall_s=60)
    assert [r["total"] for r in forked["ranks"]] == [r["total"] for r in fresh["ranks"]] == [12.0] * 4
    assert {r["comm"] for r in forked["ranks"]} == {f"dcp-rank{r}" for r in range(4)}
    assert not any(r["comm"].startswith("dcp-") for r in fresh["ranks"])
    # forked ranks share the zygote's hash seed, so a rank-to-rank difference from iterating a set of strings shows
    # only on fresh ranks (test_fresh_ranks.py trains on them)
    assert len({r["hash"] for r in forked["ranks"]}) == 1 and len({r["hash"] for r in fresh["ranks"]}) == 4
    assert not zygote.forked_alive()


def test_a_signal_that_comes_before_the_fork_reaches_the_rank_once_it_exists(tmp_path):
    """The zygote here is the test's: it takes the request, waits until the client has had its SIGTERM, then
    answers with the pid of a process of its own and reports how that process ended."""
    import socket
    import struct
    import threading

    path = str(tmp_path / "sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    proc = _client(path, "exit")
    conn, _ = listener.accept()
    socket.recv_fds(conn, 1 << 16, 3)
    proc.send_signal(signal.SIGTERM)  # the client has no rank yet: it must hold the signal, not die of it
    time.sleep(0.5)
    assert proc.poll() is None, "the client died of a signal that came before its rank"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = threading.Event()

    def report() -> None:
        status = os.waitpid(sleeper.pid, 0)[1]
        conn.sendall(struct.pack("!i", status))
        done.set()

    conn.sendall(struct.pack("!i", sleeper.pid))
    threading.Thread(target=report, daemon=True).start()
    try:
        proc.wait(30)
        done.wait(10)
    finally:
        sleeper.kill()
        conn.close()
        listener.close()
    assert done.wait(10) and proc.returncode == -signal.SIGTERM  # the signal reached the rank, which died of it


def test_a_launcher_that_exits_leaves_no_zygote_and_no_socket_folder(tmp_path):
    code = ("import os, sys; from harness.jobs import zygote; at = zygote.address(dict(os.environ)); "
            "print(at, zygote._servers[zygote._key(dict(os.environ))][0].pid)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    at, pid = r.stdout.split()
    assert not Path(at).parent.exists(), f"{Path(at).parent} outlived its launcher"
    assert _gone(int(pid), 10), f"zygote {pid} outlived its launcher"


def test_a_killed_launcher_leaves_no_zygote_and_no_socket_folder(tmp_path):
    """SIGKILL leaves no ``atexit``: the zygote sees its launcher go, removes its folder and ends."""
    code = ("import os, sys, time; from harness.jobs import zygote; at = zygote.address(dict(os.environ)); "
            "print(at, zygote._servers[zygote._key(dict(os.environ))][0].pid, flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        at, pid = launcher.stdout.readline().split()
        assert Path(at).exists() and not _gone(int(pid), 0.2)
    finally:
        launcher.kill()
        launcher.communicate(timeout=30)
    assert _gone(int(pid), 10), f"zygote {pid} outlived its SIGKILLed launcher"
    deadline = time.monotonic() + 5
    while Path(at).parent.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(at).parent.exists(), f"{Path(at).parent} outlived its SIGKILLed launcher"


def _launcher_sees(env: dict) -> dict:
    """What a launcher started with ``env`` gets from ``address`` for its jobs' import environment, and whether it
    started a zygote of its own."""
    code = ("import json; from harness.jobs import launcher, zygote; at = zygote.address(launcher._env()); "
            "print(json.dumps({'at': at, 'own': bool(zygote._servers)}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_launchers_started_after_share_fork_from_the_shared_zygote_when_their_imports_match():
    """``share()`` (a test session, a script running many jobs): a launcher it starts uses its zygote and starts
    none of its own; the socket is not taken for another import environment (here ``OMP_NUM_THREADS``) nor once
    the sharing process is gone (a launcher then starts its own, as without the variable)."""
    code = "import os; from harness.jobs import launcher; print(launcher.share_zygote(), flush=True); input()"
    sharer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        at = sharer.stdout.readline().strip()
        assert Path(at).is_socket(), at
        env = {**os.environ, zygote.SHARED: at}
        assert _launcher_sees(env) == {"at": at, "own": False}
        key = zygote._key(_jobs_env(env))
        assert zygote._serves(at, key)
        assert not zygote._serves(at, zygote._key({**_jobs_env(env), "OMP_NUM_THREADS": "3"}))
        proc = _client(at, "exit")  # and the shared zygote forks ranks like any other
        proc.communicate(timeout=60)
        assert proc.returncode == 7
    finally:
        sharer.communicate("\n", timeout=30)
    assert not Path(at).parent.exists(), "the shared zygote outlived the process that shared it"
    assert not zygote._serves(at, key)


def _jobs_env(env: dict) -> dict:
    """The environment a launcher started with ``env`` gives its jobs (``launcher._env``)."""
    import unittest.mock

    from harness.jobs import launcher

    with unittest.mock.patch.dict(os.environ, env, clear=True):
        return launcher._env()
