"""The process torchrun starts for a rank served by the zygote (``harness.jobs.zygote``).

Run by path (``python -u zygote_client.py SOCKET MODULE ARGS...``), it imports only the standard library:
it hands the zygote its command line, environment, working directory and stdio, relays the signals it gets
to the forked rank and exits as the rank did. Without a zygote to reach it runs ``python -u -m MODULE
ARGS...`` itself.
"""

import ctypes
import json
import os
import signal
import socket
import struct
import sys

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _die_with_parent() -> None:
    """SIGKILL this process when torchrun exits (Linux ``PR_SET_PDEATHSIG``), as every rank asks."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def main() -> None:
    path, module, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # torchrun died before the request took effect
        os._exit(3)
    target: list[int] = []
    pending: list[int] = []

    def relay(signum, frame):
        if target:
            _send(target[0], signum)
        else:
            pending.append(signum)

    for s in RELAYED:
        signal.signal(s, relay)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # no zygote: be the rank (exec restores the default signal handling)
        conn.close()
        for signum in pending:  # a signal that came first ends the client as it would have ended the rank
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        os.execv(sys.executable, [sys.executable, "-u", "-m", module, *argv])
    payload = json.dumps({"module": module, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(conn, [struct.pack("!I", len(payload)) + payload], [0, 1, 2])
        head = _recv_exact(conn, 4)
    except OSError as e:
        print(f"dcp-harness: the rank zygote at {path} failed before starting the rank: {e}", file=sys.stderr)
        os._exit(1)
    if head is None:
        print(f"dcp-harness: the rank zygote at {path} closed the connection before starting the rank",
              file=sys.stderr)
        os._exit(1)
    (forked,) = struct.unpack("!i", head)
    target.append(forked)
    for signum in pending:  # what arrived before the rank had a pid
        _send(forked, signum)
    status = _recv_exact(conn, 4)
    if status is None:
        print(f"dcp-harness: the rank zygote at {path} went away while rank process {forked} ran", file=sys.stderr)
        os._exit(1)
    (status,) = struct.unpack("!i", status)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
