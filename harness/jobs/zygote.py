"""Start torchrun's rank processes without paying torch's import in each (CPU jobs).

A rank of a torchrun job is a fresh Python that imports torch: ~2-3 s of CPU before it does anything, on
every rank of every job. For a CPU job the launcher (``harness.jobs.launcher``) instead starts one *zygote*
per process (per import environment): a server that imports torch once and forks a rank for each request.
torchrun still starts, watches and stops every rank: the process it starts is a thin client
(``zygote_client.py``, run by path: it imports nothing of the harness nor torch) that

- hands the zygote its command line, environment, working directory and its stdin / stdout / stderr;
- relays the signals torchrun sends it (SIGTERM, SIGINT, ...) to the forked rank;
- exits as the rank exited (its exit code, or killed by the same signal), so torchrun's summary names the
  rank and its exit code as it would for a plain rank;
- takes the rank down with it when it dies itself (the rank watches the client's end of the connection
  and kills itself on EOF; a SIGKILLed client, or one killed with its torchrun, leaves no rank behind).

The forked rank writes its heartbeats with its own pid, so the launcher's stall checks and kill paths name
and reach the process that runs the job. A client that cannot reach the zygote runs the rank itself
(``exec`` of ``python -u -m harness.jobs.entry ...``): the zygote saves time, it is never needed.

Only CPU jobs use it (a CUDA job's ranks must not fork from a process that might have touched the driver,
and their start-up is small beside their run); ``DCP_HARNESS_ZYGOTE=0`` turns it off. What the forked rank
does not get from a fresh process: torch's import-time state is the zygote's (it is keyed by the variables
torch reads at import, ``IMPORT_ENV``), and Python's string hash seed is the zygote's for every rank of
the job (a fresh process draws its own); a GPU run or ``DCP_HARNESS_ZYGOTE=0`` runs ranks as fresh
processes.

One zygote can serve several launchers: ``share()`` starts one and names its socket in ``DCP_HARNESS_ZYGOTE_AT``,
which the processes started afterwards inherit, so a script or test session that runs many CPU jobs (each a
``dcp-harness`` process) pays torch's import once instead of once a job (~4 s of CPU each). A launcher uses the
named zygote only where it was started for the same import environment (its key, written beside the socket);
otherwise it starts its own, as without the variable. The shared zygote lives as long as the process that
called ``share()``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ENV = "DCP_HARNESS_ZYGOTE"
"""``0`` / ``off`` / ``false``: every rank a fresh process (no zygote)."""
IMPORT_ENV = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP", "CUDA", "NVIDIA", "LD_", "TMPDIR")
"""Prefixes of the variables read while torch imports: one zygote serves one set of their values."""
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._functorch.aot_autograd")
"""What the zygote imports before it forks: torch, and what ranks import as they run (``torch._dynamo``, AOT
autograd: ~2 s a rank; the CPU main job 73 -> 59 s). Nothing that starts threads or touches CUDA."""
START_TIMEOUT_S = 120.0
CLIENT = Path(__file__).with_name("zygote_client.py")
LENGTH = struct.Struct("!I")
STATUS = struct.Struct("!i")


SHARED = "DCP_HARNESS_ZYGOTE_AT"
"""The socket of a running zygote (``share()``) that launchers use when it serves their import environment."""
KEY_FILE = "key.json"
"""Beside the socket: the import environment the zygote serves (``_key``), for launchers that did not start it."""


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


RUNTIME_ENV = ("TORCHELASTIC_", "TORCH_NCCL_")
"""Prefixes under ``IMPORT_ENV``'s that torch reads only at run time (the elastic agent, NCCL's process groups):
torchrun sets them for its ranks, whose side jobs (``converge``'s reference under a user's torchrun) may then share
the zygote of the process that started torchrun."""


def _key(env: dict) -> tuple:
    return (sys.executable, *sorted((k, v) for k, v in env.items()
                                    if k.startswith(IMPORT_ENV) and not k.startswith(RUNTIME_ENV)))


_servers: dict[tuple, tuple[subprocess.Popen, str]] = {}
_lock = threading.Lock()


def _stop(proc: subprocess.Popen, path: str) -> None:
    """End a zygote and remove its socket's private folder."""
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@atexit.register
def _stop_all() -> None:  # a launcher that exits leaves no zygote and no socket folder behind
    for proc, path in list(_servers.values()):
        _stop(proc, path)
    _servers.clear()


def address(env: dict) -> str | None:
    """The socket of a running zygote for ranks started with ``env`` (started now if need be); None when
    none can be had (turned off, or it did not start: the ranks then run as fresh processes)."""
    if not enabled() or not sys.platform.startswith("linux"):
        return None
    key = _key(env)
    shared = os.environ.get(SHARED)
    if shared and _serves(shared, key):
        return shared
    with _lock:
        found = _servers.get(key)
        if found is not None and found[0].poll() is None:
            return found[1]
        if found is not None:
            _servers.pop(key)
            _stop(*found)
        started = _start(env)
        if started is not None:
            _servers[key] = started
        return started[1] if started else None


def _serves(path: str, key: tuple) -> bool:
    """Whether the zygote at ``path`` is up and was started for the import environment ``key``."""
    try:
        written = json.loads((Path(path).parent / KEY_FILE).read_text())
    except (OSError, ValueError):
        return False
    return written == json.loads(json.dumps(key)) and Path(path).is_socket()


def share(env: dict) -> str | None:
    """Start (or reuse) this process's zygote for ranks started with ``env`` and name it in ``SHARED`` for the
    processes started from now on; its socket, or None when no zygote can be had."""
    at = address(env)
    if at is not None:
        os.environ[SHARED] = at
    return at


def _start(env: dict) -> tuple[subprocess.Popen, str] | None:
    from harness.jobs.watchdog import die_with_parent

    path = os.path.join(tempfile.mkdtemp(prefix="dcp-zygote-"), "sock")
    proc = subprocess.Popen([sys.executable, "-m", "harness.jobs.zygote", path], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    if not ready or proc.stdout.readline() != b"ready\n":
        _stop(proc, path)
        return None
    proc.stdout.close()
    key_file = Path(path).parent / KEY_FILE
    key_file.with_suffix(".tmp").write_text(json.dumps(_key(env)))
    key_file.with_suffix(".tmp").replace(key_file)  # whole or absent, for a launcher reading it now
    return proc, path


def command(path: str, module: str, argv: list[str]) -> list[str]:
    """The client's arguments for ``python -m MODULE ARGV`` served by the zygote at ``path`` (run them with
    ``python -u``; torchrun does so for a script)."""
    return [str(CLIENT), path, module, *argv]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client went away mid-request")
        data += chunk
    return data


def _request(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, LENGTH.size, 3)
    if len(head) < LENGTH.size:
        head += _recv_exact(conn, LENGTH.size - len(head))
    (n,) = LENGTH.unpack(head)
    return json.loads(_recv_exact(conn, n)), fds


def serve(path: str) -> None:
    """The zygote: import torch, then fork a rank per request and report each one's wait status."""
    import importlib
    import signal

    _clean_up_when_orphaned(path)
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    pending: dict[int, socket.socket] = {}
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the launcher went before the signal below was asked for
            os.kill(os.getpid(), signal.SIGTERM)
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            conn, _ = listener.accept()
            try:
                conn.settimeout(10)
                req, fds = _request(conn)
                conn.settimeout(None)
            except (OSError, ValueError, ConnectionError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            # SIGTERM is blocked across the fork: a signal relayed to the child before it drops the zygote's
            # clean-up handler stays pending and then ends it as it ends a fresh process
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                listener.close()
                for other in pending.values():
                    other.close()
                _rank(conn, req, fds)  # never returns
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(STATUS.pack(pid))
            except OSError:
                pass
            pending[pid] = conn
        while pending:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = pending.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(STATUS.pack(status))
                conn.close()


def _clean_up_when_orphaned(path: str) -> None:
    """The launcher's death ends the zygote by SIGTERM (not the SIGKILL it was started with), which removes the
    socket's private folder first: a launcher that was SIGKILLed cannot run its ``atexit`` clean-up, and its folder
    was left in the temporary directory. The forked ranks die with the zygote as before (their own PDEATHSIG)."""
    import ctypes
    import signal

    def _leave(signum, frame) -> None:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, _leave)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def process_name(module: str, env: dict) -> str:
    """The forked process's name (``/proc/PID/comm``, what ``ps`` and ``pgrep`` without ``-f`` show): its command
    line is the zygote's, so ``dcp-rank<RANK>`` and ``dcp-torchrun`` tell them apart."""
    if module == "torch.distributed.run":
        return "dcp-torchrun"
    return f"dcp-rank{env['RANK']}" if env.get("RANK", "").isdigit() else "dcp-forked"


def _die_with_zygote_and_name(req: dict) -> None:
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: the zygote's death ends it
        libc.prctl(15, process_name(req["module"], req["env"]).encode()[:15], 0, 0, 0)  # PR_SET_NAME


def children(server_pid: int) -> list[int]:
    """Live (not zombie) processes the zygote ``server_pid`` forked (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and int(fields[1]) == server_pid and fields[0] not in "ZX":
            found.append(int(stat.parent.name))
    return found


def forked_alive() -> list[int]:
    """Live processes forked by this process's zygotes (none once every job it launched has ended)."""
    return [pid for proc, _ in list(_servers.values()) if proc.poll() is None for pid in children(proc.pid)]


def _rank(conn: socket.socket, req: dict, fds: list[int]) -> None:
    """In the forked child: become the rank the client would have run, then run it."""
    import io
    import runpy
    import signal
    import traceback

    code = 1
    try:
        _die_with_zygote_and_name(req)
        os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True,
                                      errors="backslashreplace")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
                                      errors="backslashreplace")
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[0] = req["cwd"]  # as ``python -m`` run there would have it
        sys.argv = [req["module"], *req["argv"]]
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import torch

        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))

        def _watch_client() -> None:  # the client's end closed: it died (or was killed); so does the rank
            try:
                while conn.recv(64):
                    pass
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=_watch_client, name="zygote-client-watch", daemon=True).start()
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # as a fresh process ends on an unhandled Ctrl-C: its traceback, then SIGINT
        traceback.print_exc()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - a rank's failure is its traceback and exit code 1, as in a fresh process
        traceback.print_exc()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
