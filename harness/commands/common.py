"""What the command modules share: registering command modules as subcommands, the options several of them
take, and the options that override a configuration dataclass's fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

from harness import cli_types as T
from harness.jobs.nodes import DEFAULT_RDZV_TIMEOUT_S, Nodes, NodesError


class Command(Protocol):
    """What ``harness.cli`` needs of a command: a command module, or an object with the same names."""

    NAME: str
    HELP: str
    DESCRIPTION: str | None

    def add_arguments(self, parser) -> None: ...

    def run(self, args) -> int: ...


def register(sub, commands: Iterable[Command]) -> None:
    """Add each command (its ``NAME``, ``HELP``, ``DESCRIPTION`` and ``add_arguments``) to the subparsers ``sub``."""
    for c in commands:
        c.add_arguments(sub.add_parser(c.NAME, help=c.HELP, description=c.DESCRIPTION))


def add_stall(p) -> None:
    p.add_argument("--stall-timeout", type=T.STALL_S, default=None, metavar="SECONDS",
                   help=f"fail when no rank reports progress for this long, naming the rank ({T.MIN_STALL_S:g} to "
                        f"{T.MAX_STALL_S:g}; default: 180 on CPU, 900 on CUDA); collectives time out at twice this")


def add_nodes(p) -> None:
    """The multi-node options (``harness.jobs.nodes``): give every node the same command with its own --node-rank."""
    g = p.add_argument_group("several machines (every node runs this command; node 0 writes the reports)")
    g.add_argument("--nnodes", type=T.NODES, default=1, help="machines in the job (default 1)")
    g.add_argument("--node-rank", type=T.NODE_RANK, default=0, help="this machine's rank, 0 .. nnodes - 1")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="where the nodes meet: node 0's address and a free port there, the same on every node")
    g.add_argument("--rdzv-timeout", type=T.STALL_S, default=None, metavar="SECONDS",
                   help="fail, naming the endpoint, when the nodes have not all started within this long (300)")
    g.add_argument("--numa-binding", default=None, metavar="MODE",
                   help="bind each rank to the CPUs near its GPU (torchrun's --numa-binding, torch >= 2.9, GPU runs): "
                        "node, socket, exclusive (CPUs of its own) or core-complex; default: no binding")


def nodes_from(a, world: int, device: str = "cuda"):
    """The ``Nodes`` of the options, checked, and the processes this node runs (``world`` / nnodes); ``device``: the
    job's (``--numa-binding`` binds ranks to the CPUs near their GPUs: refused for a CPU job)."""
    numa = getattr(a, "numa_binding", None)
    if numa is not None and device == "cpu":
        raise NodesError(f"--numa-binding {numa} binds each rank to the CPUs near its GPU: a CPU job has none; leave "
                         "it out on the CPU")
    nodes = Nodes(a.nnodes, a.node_rank, a.rdzv_endpoint, a.rdzv_timeout or DEFAULT_RDZV_TIMEOUT_S, numa)
    nodes.check()
    if world % nodes.nnodes:
        raise NodesError(f"--world {world} cannot be split evenly over --nnodes {nodes.nnodes}: give a world that is "
                         f"a multiple of the node count (each node runs world / nnodes processes)")
    return nodes, world // nodes.nnodes


def add_out(p, name: str) -> None:
    """A benchmark's ``--out``: its JSON, ``reports/<name>`` by default."""
    p.add_argument("--out", type=Path, default=None, help=f"JSON path (default reports/{name})")


def names(text: str) -> tuple[str, ...] | None:
    """A comma-separated option's non-empty items; None (keep the default) when it has none."""
    return tuple(x.strip() for x in text.split(",") if x.strip()) or None


def overrides(args, config: type, convert: Mapping[str, Callable] | None = None) -> dict:
    """The fields of the dataclass ``config`` that the options set: every option whose dest is a field's name
    and whose value is not None, passed through ``convert[name]`` where its text needs parsing first (a
    converter returning None keeps the default too)."""
    convert = convert or {}
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(args, f.name, None)
        if value is not None and f.name in convert:
            value = convert[f.name](value)
        if value is not None:
            out[f.name] = value
    return out
