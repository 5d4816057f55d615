"""Jobs on several machines: which node this is, where the nodes meet, and what each must agree on.

``Nodes(nnodes, node_rank, endpoint)`` is what the user gives every node's command (``--nnodes N --node-rank R
--rdzv-endpoint HOST:PORT``): the launcher starts torchrun with its static rendezvous (``--master-addr HOST
--master-port PORT --node-rank R``), so node R holds the global ranks ``R x nproc .. (R + 1) x nproc - 1`` and
node 0 holds rank 0, which writes the results: the reports are written on node 0 (torchrun's ``c10d``
rendezvous would number the nodes in the order they arrive, so which node reports would be a race).

Before a job starts, ``check`` refuses (one line, naming the value and the fix) a node rank outside
``0 .. nnodes - 1``, an endpoint that is not ``HOST:PORT``, and - on node 0, which serves the rendezvous - a port
already in use. Inside the job every rank checks that every node runs the same number of processes
(``harness.jobs.peers.check_nodes_agree``).
"""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass

from harness.plan.errors import PlanInputError

MAX_NODES = 4096
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")
"""torchrun's ``--numa-binding`` modes (torch >= 2.9): each rank bound to CPUs near its GPU (``exclusive``: CPUs of
its own, shared with no other rank)."""
DEFAULT_RDZV_TIMEOUT_S = 300.0
"""How long the nodes may take to meet (every node's command started) before the job fails naming the endpoint."""


class NodesError(PlanInputError):
    """A multi-node option no job can run with (one line: the value, the limit, the fix)."""


@dataclass(frozen=True)
class Nodes:
    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    """``HOST:PORT`` where the nodes meet: node 0's address, a free port there."""
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    numa_binding: str | None = None
    """torchrun's ``--numa-binding`` mode for this node's ranks (``NUMA_BINDINGS``); None: the ranks run wherever the
    OS puts them."""

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def reports_here(self) -> bool:
        """Node 0 holds global rank 0: it gets the job's results and writes the reports."""
        return self.node_rank == 0

    def host_port(self) -> tuple[str, int]:
        host, sep, port = (self.endpoint or "").rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise NodesError(f"--rdzv-endpoint {self.endpoint!r} is not HOST:PORT with a port from 1 to 65535; give "
                             "node 0's address and a free port there, e.g. --rdzv-endpoint node0.cluster:29500")
        return host.strip("[]"), int(port)

    def check(self) -> None:
        """Refuse options no job can run with (``NodesError``); on node 0, a rendezvous port already in use."""
        if not isinstance(self.nnodes, int) or not 1 <= self.nnodes <= MAX_NODES:
            raise NodesError(f"--nnodes {self.nnodes!r} must be an integer from 1 to {MAX_NODES}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise NodesError(f"--node-rank {self.node_rank!r} is out of range for --nnodes {self.nnodes}: give each "
                             f"node a distinct rank from 0 to {self.nnodes - 1} (node 0 writes the reports)")
        if self.numa_binding is not None:
            _check_numa_binding(self.numa_binding)
        if not self.multi:
            return
        if self.endpoint is None:
            raise NodesError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address and a free "
                             "port), the same on every node")
        host, port = self.host_port()
        if not 1.0 <= self.rdzv_timeout_s <= 86400.0:
            raise NodesError(f"--rdzv-timeout {self.rdzv_timeout_s!r} must be from 1 to 86400 seconds")
        if self.node_rank == 0 and _is_local(host) and not _port_free(host, port):
            raise NodesError(f"port {port} on {host} (--rdzv-endpoint) is in use: node 0 serves the rendezvous there; "
                             "pick a free port and give the same endpoint to every node")

    def torchrun_args(self) -> list[str]:
        """torchrun's options for this node (one node: a private rendezvous on a free local port)."""
        numa = [f"--numa-binding={self.numa_binding}"] if self.numa_binding else []
        if not self.multi:
            return ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", *numa]
        host, port = self.host_port()
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--master-addr={host}",
                f"--master-port={port}", *numa]

    def first_rank(self, nproc: int) -> int:
        return self.node_rank * nproc

    def describe(self) -> str:
        return f"node {self.node_rank} of {self.nnodes}" if self.multi else "one node"


def _check_numa_binding(mode: str, torch_version: str | None = None) -> None:
    """Refuse a ``--numa-binding`` mode torchrun does not have, or a torch whose torchrun has no such option."""
    if mode not in NUMA_BINDINGS:
        raise NodesError(f"--numa-binding {mode!r} is not one of torchrun's modes: {', '.join(NUMA_BINDINGS)} (node: "
                         "if in doubt; exclusive: no two ranks share a CPU)")
    if torch_version is None:
        import torch  # lazy: only a job that asks for a binding pays for it (it imports torch anyway)

        torch_version = torch.__version__
    version = str(torch_version)
    major_minor = re.match(r"(\d+)\.(\d+)", version)
    if major_minor is None or tuple(map(int, major_minor.groups())) < (2, 9):
        raise NodesError(f"--numa-binding needs torchrun's --numa-binding (torch >= 2.9); this torch is {version}: "
                         "upgrade torch or leave the option out")


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname()):
        return True
    with contextlib.suppress(OSError):
        return socket.gethostbyname(host) in ("127.0.0.1", socket.gethostbyname(socket.gethostname()))
    return False


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if host in ("0.0.0.0", "::") else host, port))
        except OSError:
            return False
    return True
