"""Bounded multi-process jobs: every rank reports its progress, the launcher watches, a failure is one line.

Rank side: ``harness.heartbeat.Heartbeat`` (a rank's progress reports, written where this side reads them).

Launcher side (``harness.jobs.entry.launch``): ``stalled(...)`` says when no rank has reported for
``stall_s`` seconds and names the rank to blame - a stopped or still-computing process first, then
the one whose last report is oldest - with its last report; ``first_failure(...)`` names the rank that
failed first once the job has exited: its own exception, or a death without a traceback (a signal),
before the "connection reset" / timeout errors its partners raise afterwards.

>>> import tempfile; from harness.heartbeat import Heartbeat; d = tempfile.mkdtemp()
>>> Heartbeat(d, 1).beat(force=True, step=3, of=50)
>>> read_beats(d)[1]["step"], describe(read_beats(d)[1])
(3, 'step 3 of 50')
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

PEER_ERRORS = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|Timed out|[Tt]imeout|timed out|NCCL communicator was aborted|"
    r"ProcessGroup.*(aborted|shutdown)|Socket Timeout|Connection refused|Application timeout caused pair closure|"
    r"read or write failed|EOF")
"""Errors a rank raises because a *partner* failed (so it is not the first failure)."""


class JobFailure(RuntimeError):
    """A launched job failed: a rank raised, died or stopped making progress. ``rank``: the rank that
    failed first (None if unknown); ``log``: the file with the job's whole output."""

    def __init__(self, message: str, rank: int | None = None, log: Path | None = None):
        self.rank, self.log = rank, log
        super().__init__(message + (f"; output: {log}" if log else ""))


def read_beats(folder) -> dict[int, dict]:
    out = {}
    for p in Path(folder).glob("rank*.json"):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now: the next poll reads it
        out[int(d["rank"])] = d
    return out


def describe(beat: dict | None) -> str:
    """A rank's last report in words: 'layout dcp, step 17 of 50'."""
    if not beat:
        return "no report since it started"
    parts = [f"{k} {v}" for k, v in beat.items() if k not in ("rank", "pid", "time", "step", "of")]
    if "step" in beat:
        parts.append(f"step {beat['step']}" + (f" of {beat['of']}" if "of" in beat else ""))
    return ", ".join(parts) or "started"


def process_state(pid: int | None) -> str:
    """'stopped', 'running', 'waiting', or 'gone' (Linux /proc; 'unknown' elsewhere)."""
    if not pid:
        return "unknown"
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return "unknown"
    return {"T": "stopped", "t": "stopped", "R": "running", "Z": "gone", "X": "gone"}.get(state, "waiting")


STARTUP_S = 300.0
"""Until every rank has reported once (imports, process-group set-up, CUDA initialisation on a busy
machine), the limit is ``max(stall_s, STARTUP_S)`` from the launch."""


def stalled(folder, nproc: int, started: float, stall_s: float, now: float | None = None,
            first: int = 0) -> tuple[int, str] | None:
    """(rank, message) when no rank has reported for ``stall_s`` seconds (before every rank has
    reported once: ``max(stall_s, STARTUP_S)`` since ``started``), else None. The ranks watched are
    ``first .. first + nproc - 1`` (a node's ranks in a multi-node job)."""
    now = time.time() if now is None else now
    ranks = range(first, first + nproc)
    beats = read_beats(folder)
    if len(beats) < nproc:
        last, limit = started, max(stall_s, STARTUP_S)
    else:
        last, limit = max(b["time"] for b in beats.values()), stall_s
    if now - last < limit:
        return None
    states = {r: process_state(beats[r].get("pid")) if r in beats else "silent" for r in ranks}
    order = {"stopped": 0, "silent": 1, "running": 2, "gone": 3, "unknown": 4, "waiting": 5}
    rank = min(ranks, key=lambda r: (order[states[r]], beats.get(r, {}).get("time", 0.0), r))
    why = {"stopped": " (its process is stopped, e.g. by SIGSTOP)", "running": " (its process is still computing)",
           "gone": " (its process is gone)"}.get(states[rank], "")
    return rank, (f"rank {rank} made no progress for {now - last:.0f} s{why}; its last report: "
                  f"{describe(beats.get(rank))}")


def peer_failure(folder) -> tuple[int, str] | None:
    """(rank, message) when a rank of this node saw a rank of another node stop (``harness.jobs.peers``)."""
    notes = []
    for p in Path(folder).glob("rank*.peer"):
        try:
            notes.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    if not notes:
        return None
    n = min(notes, key=lambda x: x["time"])
    return n["peer"], describe_peer(n)


def describe_peer(n: dict) -> str:
    """The line for a peer note (``harness.jobs.peers``): which rank of which node stopped, seen by which rank."""
    if n.get("store_error"):
        return (f"rank {n['rank']} lost the rendezvous store on node 0 ({n['store_error']}): node 0 died or its "
                "agent stopped")
    how = "went away: this node's ranks lost their connections to it" if n.get("after_error") else \
        f"stopped reporting for {n['silent_s']:.0f} s" if n.get("started") else f"never reported in {n['silent_s']:.0f} s"
    return (f"rank {n['peer']} on node {n['node']} {how} (seen by rank {n['rank']}): its process died or was "
            f"stopped, or node {n['node']} went away")


def first_failure(folder, nproc: int, gone_at: dict[int, float], exit_codes: dict[int, int],
                  root_cause: int | None = None, first: int = 0) -> tuple[int | None, str]:
    """(rank, why) of the first real failure of an exited job: an own exception (earliest), a rank that
    died without one (torchrun's ``root_cause`` rank first, then by ``gone_at``: when the launcher saw
    its process vanish; a SIGTERM is how torchrun stops the survivors, so it ranks last; ``exit_codes``
    from torchrun's report, negative = signal), then partners' errors. ``nproc`` and ``first`` (this node's
    share of the ranks) are the caller's: the errors are read from whatever ranks wrote them."""
    errors = {}
    # every error this node's ranks wrote, whatever their numbers: on nodes that started different numbers of
    # processes (a mistake the ranks report) the ranks are not numbered from ``first`` on
    for p in Path(folder).glob("rank*.error"):
        if not p.name[4:-6].isdigit():
            continue
        stamp, _, text = p.read_text().partition("\n")
        errors[int(p.name[4:-6])] = (float(stamp), text.strip().splitlines()[-1] if text.strip() else "an exception")
    own = {r: e for r, e in errors.items() if not PEER_ERRORS.search(e[1])}
    if own:
        r = min(own, key=lambda k: own[k][0])
        return r, f"raised {own[r][1]}"
    silent = {r: t for r, t in gone_at.items() if r not in errors}
    silent.update({r: float("inf") for r, c in exit_codes.items() if r not in errors and r not in silent and c})
    if silent:
        r = min(silent, key=lambda k: (k != root_cause, exit_codes.get(k) == -15, silent[k], k))
        code = exit_codes.get(r)
        how = f"was killed by signal {-code}" if code and code < 0 else \
            f"exited with code {code}" if code else "died"
        return r, f"{how} without a Python traceback"
    if errors:
        r = min(errors, key=lambda k: errors[k][0])
        return r, f"raised {errors[r][1]}"
    return None, "exited with an error before any rank reported"


class Terminated(KeyboardInterrupt):
    """The launcher was sent SIGTERM or SIGHUP while a job ran; the job's processes were killed. ``log``: the
    file with the job's output so far (set by ``harness.jobs.entry.launch``; None when unknown)."""

    log: Path | None = None


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux ``PR_SET_PDEATHSIG``; a
    no-op elsewhere): torchrun under a launcher that was killed, a rank under a torchrun that was, end
    too instead of running on unsupervised. Called in the child, first thing."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
