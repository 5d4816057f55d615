"""What the ranks of a multi-node job check among themselves, through the rendezvous store of node 0's agent.

- ``check_nodes_agree``: before the process group forms, every node's first rank publishes how many processes
  its node runs and its host name, and every node compares: nodes that run different numbers of processes
  would wait for ranks that never come; the job stops at once, naming the nodes and the fix.
- ``PeerWatch``: every rank ticks a counter in the store once a second and watches the other nodes' counters; a
  rank whose counter stops for half the stall limit (its process died, was stopped, or its node went away) is written to
  this rank's heartbeat folder as ``rank<r>.peer`` (``harness.heartbeat.Heartbeat.note``), where this node's
  launcher finds it and ends the job with one line naming that node and rank. A rank that is alive but makes no
  progress is named by its own node's launcher (``harness.jobs.watchdog.stalled``). A rank whose collective fails
  because a peer's connection reset (the peer died) asks the store which ranks stopped ticking (``diagnose``).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import time

TICK_S = 1.0


def _store(timeout_s: float):
    import torch.distributed as dist  # lazy: imports torch; the launcher side imports this package without it

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=dt.timedelta(seconds=timeout_s))


class NodeMismatchError(RuntimeError):
    """The nodes of a job run different numbers of processes."""


def check_nodes_agree(nnodes: int, timeout_s: float, store=None) -> None:
    """Raise ``NodeMismatchError`` on every node's ranks unless every node runs as many processes as node 0."""
    store = store or _store(timeout_s)
    node, local = int(os.environ.get("GROUP_RANK", 0)), int(os.environ["LOCAL_WORLD_SIZE"])
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        store.set(f"harness/node/{node}", f"{local} {socket.gethostname()}")
    seen = {}
    for n in range(nnodes):
        count, _, host = store.get(f"harness/node/{n}").decode().partition(" ")
        seen[n] = (int(count), host)
    odd = [n for n in seen if seen[n][0] != seen[0][0]]
    if odd:
        n = odd[0]
        raise NodeMismatchError(f"node {n} ({seen[n][1]}) runs {seen[n][0]} processes, node 0 ({seen[0][1]}) runs "
                                f"{seen[0][0]}: every node must start the same number of processes (give every node the same --world and --nnodes)")


class PeerWatch:
    """The liveness of the other nodes' ranks, seen from this rank (see the module doc)."""

    def __init__(self, rank: int, world: int, local: int, stall_s: float, heartbeat, store=None, on_peer=None):
        """``on_peer(note)``: what to do when a peer stops (default: write it to ``heartbeat``, where this node's
        launcher reads it; a rank its user's launcher started prints the line and leaves instead)."""
        self.rank, self.world, self.local, self.heartbeat = rank, world, local, heartbeat
        self.on_peer = on_peer or (lambda note: heartbeat.note("peer", **note))
        self.seen: dict | None = None
        # a live process ticks every second whatever its main thread does; silence for half the launcher's stall
        # limit names the other node's rank before this node's launcher blames its own (waiting) ranks
        self.stall_s = max(5.0, stall_s / 2)
        self.store = store or _store(max(stall_s, 30.0))
        self.node = rank // local
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harness-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def diagnose(self, wait_s: float = 2.5 * TICK_S) -> bool:
        """After this rank lost a connection: note the first rank of another node whose ticks stopped (True when
        one did). Called from the rank's error path, so that the job names the node that went away rather than
        this rank's 'connection reset'."""
        self.stop()
        others = [r for r in range(self.world) if r // self.local != self.node]
        try:
            before = {r: self.store.add(f"harness/tick/{r}", 0) for r in others}
            time.sleep(wait_s)
            after = {r: self.store.add(f"harness/tick/{r}", 0) for r in others}
        except Exception:  # noqa: BLE001 - the store itself is gone (node 0 went away): the watch thread says so
            return False
        dead = [r for r in others if after[r] == before[r]]
        if dead:
            self._report(peer=dead[0], node=dead[0] // self.local, silent_s=wait_s, started=True, after_error=True)
        return bool(dead)

    def _report(self, **note) -> None:
        self.seen = {"rank": self.rank, "time": time.time(), **note}
        self.on_peer(note)

    def _run(self) -> None:
        others = [r for r in range(self.world) if r // self.local != self.node]
        last = {r: (-1, time.monotonic()) for r in others}
        try:
            while not self._stop.wait(TICK_S):
                self.store.add(f"harness/tick/{self.rank}", 1)
                now = time.monotonic()
                for r in others:
                    v = self.store.add(f"harness/tick/{r}", 0)
                    if v != last[r][0]:
                        last[r] = (v, now)
                    elif now - last[r][1] > self.stall_s:
                        self._report(peer=r, node=r // self.local, silent_s=now - last[r][1], started=v > 0)
                        return
        except Exception as e:  # noqa: BLE001 - the store's host (node 0) is gone: say so, once
            if not self._stop.is_set():
                self._report(peer=0, node=0, silent_s=None, started=True, store_error=str(e)[:200])
