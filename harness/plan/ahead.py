"""Plan global batches ahead of the training loop, in a planner process.

A scheduler that runs inline is host time on every step's critical path: ``balanced`` needs 1-5 ms
per global batch at 4-16 ranks, 0.5-1.5% of a 300 ms step on 4 H200s, and the GPUs wait for it.
The schedule of batch k + 1 depends only on its sequence lengths (known to the data loader before
the batch is read) and the cost model, so it can be computed while step k runs - NVIDIA describes
Megatron's dynamic-CP solver as asynchronous for this reason (``../shared/specs/peers.md``,
"zero-overhead"). A Python thread would compete for the GIL with the thread that enqueues the
step's kernels (on an H200 a micro-batch is close to host-bound); a separate process does not.

``PlanAhead(fn)`` starts one process (``python -m harness.plan.ahead``) that imports ``fn`` (a
``"module:name"`` string: the function must be importable, not a closure) and calls it on every
request, in order::

    with PlanAhead("harness.train.layouts:plan") as ahead:
        ahead.submit("dcp", lengths[0], cfg, cost)
        for k in range(steps):
            (sched, padding, fixed), seconds = ahead.result()  # waits only if the planner is behind
            if k + 1 < steps:
                ahead.submit("dcp", lengths[k + 1], cfg, cost)
            ...  # run step k with ``sched`` while batch k + 1 is planned

Results come back in submission order, with the seconds the call took in the planner. The planner
runs the same function on the same inputs, so its schedules are identical to inline ones (the
determinism rule holds; ``suites/plan/test_plan_ahead.py`` checks it). An exception raised by ``fn``
is raised again by ``result()`` (same type and message when it pickles, else ``PlanAheadError``
with its text); a planner that dies or does not answer within ``timeout`` raises
``PlanAheadError`` - never a hang. Messages are length-prefixed pickles over pipes; a reader thread
drains results as they arrive, so neither side can block the other on a full pipe.
"""

from __future__ import annotations

import importlib
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from harness.plan.errors import PlanInputError

_HEADER = struct.Struct("<Q")


class PlanAheadError(RuntimeError):
    """The planner process failed, died or did not answer in time (names what happened and the fix)."""


def _resolve(spec: str):
    """``"module:name"`` -> the function (dotted names after the colon reach attributes)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise PlanInputError(f"the planning function must be given as 'module:name', got {spec!r}; "
                             f"e.g. 'harness.train.layouts:plan'")
    mod, name = spec.split(":")
    try:
        obj = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise PlanInputError(f"cannot import the planning function {spec!r}: {e}") from e
    if not callable(obj):
        raise PlanInputError(f"{spec!r} is not callable")
    return obj


def _write_frame(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        b = os.read(fd, min(left, 1 << 20))
        if not b:
            return None  # end of file: the other side closed or died
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def _read_frame(fd: int):
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        raise EOFError
    body = _read_exact(fd, _HEADER.unpack(head)[0])
    if body is None:
        raise EOFError
    return pickle.loads(body)


_EOF = object()


class PlanAhead:
    """One planner process running ``fn`` (``"module:name"``) on submitted arguments, in order.

    ``timeout``: seconds ``result()`` waits for an answer before raising ``PlanAheadError`` (None =
    as long as the process lives). ``startup_timeout``: seconds to wait for the process to import
    ``fn`` and report ready."""

    def __init__(self, fn: str, *, timeout: float | None = 300.0, startup_timeout: float = 60.0):
        _resolve(fn)  # fail here, with the name, rather than in the process
        self.fn, self.timeout = fn, timeout
        root = str(Path(__file__).resolve().parents[2])  # the checkout (or site-packages) holding harness/
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self._proc = subprocess.Popen([sys.executable, "-m", "harness.plan.ahead", fn], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, close_fds=True)
        self._in, self._out = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        self._results: queue.Queue = queue.Queue()
        self._pending = 0
        self._closed = False
        self._broken: str | None = None  # set by a timeout: a late answer would pair with the wrong call
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        self._reader = threading.Thread(target=self._drain, name="plan-ahead-reader", daemon=True)
        self._reader.start()
        ready = self._get(startup_timeout, "start")
        if ready != ("ready", fn):
            self.close()
            raise PlanAheadError(f"the planner process sent {ready!r} instead of its ready message")

    def _drain(self) -> None:
        while True:
            try:
                msg = _read_frame(self._out)
            except (EOFError, OSError):
                self._results.put(_EOF)
                return
            self._results.put(msg)

    def _usable(self) -> None:
        if self._broken:
            raise PlanAheadError(f"{self._broken} earlier; its later answers would no longer match their calls, "
                                 f"so this PlanAhead refuses further use: make a new one")

    def _get(self, timeout: float | None, what: str):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                msg = self._results.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    self._broken = f"the planner process ({self.fn}) did not {what} within {timeout} s"
                    raise PlanAheadError(f"{self._broken}; raise PlanAhead(timeout=...) for batches this large, "
                                         f"or plan inline") from None
                continue
            if msg is _EOF:
                self._results.put(_EOF)  # later calls see it too
                code = self._proc.wait(timeout=10)
                raise PlanAheadError(f"the planner process ({self.fn}) exited with code {code} before it could "
                                     f"{what}; its standard error (above) says why")
            return msg

    def submit(self, *args, **kwargs) -> None:
        """Queue one call ``fn(*args, **kwargs)``; returns at once."""
        if self._closed:
            raise PlanAheadError("submit() after close(); make a new PlanAhead")
        self._usable()
        try:
            _write_frame(self._in, ("call", args, kwargs))
        except (BrokenPipeError, OSError) as e:
            raise PlanAheadError(f"the planner process ({self.fn}) is gone (exit code {self._proc.poll()}): {e}") from e
        self._pending += 1

    @property
    def pending(self) -> int:
        """Calls submitted and not yet collected by ``result()``."""
        return self._pending

    def result(self, timeout: float | None = ...):
        """(value, seconds the call took in the planner) of the oldest uncollected call; raises what
        the call raised. ``timeout`` defaults to the constructor's."""
        self._usable()
        if self._pending == 0:
            raise PlanAheadError("result() without a submitted call; submit() first")
        msg = self._get(self.timeout if timeout is ... else timeout, "answer")
        self._pending -= 1
        kind, payload, seconds = msg
        if kind == "ok":
            return payload, seconds
        exc, text = payload
        if isinstance(exc, BaseException):
            raise exc
        raise PlanAheadError(f"the planning function raised in the planner process: {text}")

    def close(self) -> None:
        """Stop the process (waits for it to finish the call it is on, at most a few seconds)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._proc.stdin.close()  # end of file: the process exits its loop
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)
        self._proc.stdout.close()
        self._finalizer.detach()

    def __enter__(self) -> PlanAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _serve(spec: str) -> int:
    """The planner process: frames in on stdin, frames out on the original stdout (stray prints go
    to standard error, so they cannot corrupt a frame)."""
    out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    fd_in = 0
    try:
        fn = _resolve(spec)
    except PlanInputError as e:
        print(f"harness.plan.ahead: {e}", file=sys.stderr)
        return 2
    _write_frame(out, ("ready", spec))
    while True:
        try:
            msg = _read_frame(fd_in)
        except EOFError:
            return 0
        _, args, kwargs = msg
        t = time.perf_counter()
        try:
            value = fn(*args, **kwargs)
            reply = ("ok", value, time.perf_counter() - t)
        except Exception as e:  # the caller re-raises it
            seconds = time.perf_counter() - t
            text = f"{type(e).__name__}: {e}"
            try:
                pickle.loads(pickle.dumps(e))
                reply = ("err", (e, text), seconds)
            except Exception:
                reply = ("err", (None, text), seconds)
        _write_frame(out, reply)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m harness.plan.ahead MODULE:FUNCTION (started by harness.plan.ahead.PlanAhead)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(_serve(sys.argv[1]))
