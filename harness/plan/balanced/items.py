"""Shared pieces of ``balanced``: a sequence as the candidates see it, rows of blocks and their step time.

A *row* is one micro-batch as a list of ``[start, size, room, items]`` blocks (room: tokens left);
``blocks_out`` turns rows into ``Blocks`` (``(size, gids)`` per block, in position order).
"""

from __future__ import annotations

from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks


class Item:
    """A sequence: ``L`` the tokens it takes in a block of its ``cp`` ranks (padded there when the schedule prices a
    padding, ``harness.plan.padding``), ``raw`` its own length, which its cost is of."""

    __slots__ = ("gid", "L", "cp", "work", "comm", "fixed", "own", "raw")

    def __init__(self, gid: int, L: int, cp: int, cost: CostModel, raw: int | None = None):
        self.gid, self.L, self.cp = gid, L, cp
        self.raw = r = L if raw is None else raw
        self.work = cost.quadratic * r * r + cost.linear * r + cost.constant
        self.comm = cost.cp_comm * r
        self.fixed = cost.per_sequence
        self.own = self.cost(cp)  # at its cp_min, where most plans run it

    def cost(self, s: int) -> float:
        """Same arithmetic as ``CostModel.seq_cost`` (so predictions match the simulator)."""
        return self.work / s + (self.comm * (s - 1) / s if s > 1 else 0.0) + self.fixed


class Infeasible(Exception):
    """This candidate cannot give every node enough sequences; try a coarser one."""


def rows_out(rows: list[list[list]], n: int, cost: CostModel) -> tuple[list[Blocks], float]:
    """Rows of ``[start, size, room, items]`` blocks -> (``Blocks`` rows, simulated step time)."""
    return blocks_out(rows), rows_time(rows, n, cost)


def blocks_out(rows: list[list[list]]) -> list[Blocks]:
    return [[(size, [x.gid for x in its]) for _, size, _, its in blocks] for blocks in rows]


def rows_time(rows: list[list[list]], n: int, cost: CostModel) -> float:
    """Simulated step time of rows of ``[start, size, room, items]`` blocks: a block starts when its
    slowest rank is free (``simulate``'s arithmetic, term for term: a single-rank block's
    ``max`` of one value is that value, and ``Item.own`` is ``cost(cp)`` computed once)."""
    free = [0.0] * n
    overhead = {}
    for blocks in rows:
        for start, size, _, its in blocks:
            if size not in overhead:
                overhead[size] = cost.block_overhead(size)
            costs = [x.own if x.cp == size else x.cost(size) for x in its]
            if size == 1:  # most blocks
                free[start] = free[start] + sum(costs) + overhead[1]
                continue
            t = max(free[start:start + size]) + sum(costs) + overhead[size]
            free[start:start + size] = [t] * size
    return max(free, default=0.0)
