"""The judge of ``balanced``'s candidates: the simulated step time of rows of ``Blocks`` under an execution model.

Independent and synchronous use ``harness.plan.execution``'s arithmetic term for term on the candidates'
own ``Item`` costs (no ``Schedule`` is built: the candidates of one call share the costs); every other model
(the pipeline) builds the ``Schedule`` and runs ``simulate_execution``. ``suites/plan/test_invariants.py``
checks the prediction against ``simulate``.
"""

from __future__ import annotations

from harness.plan.balanced.items import Item
from harness.plan.cost import CostModel
from harness.plan.execution import Execution, simulate_execution
from harness.plan.layout import Schedule, layout_from_sizes
from harness.plan.megatron_common import Blocks


class Judge:
    """Step time of candidate rows for one batch, domain, cost and execution model."""

    def __init__(self, items: list[Item], n: int, mslpr: int, cost: CostModel, execution: Execution,
                 min_cp: int = 1, vpp: int | None = None):
        self.by_gid = {it.gid: it for it in items}
        self.n, self.mslpr, self.cost, self.execution = n, mslpr, cost, execution
        self.min_cp, self.vpp = min_cp, vpp
        self.overhead = {s: cost.block_overhead(s) for s in (1 << k for k in range(n.bit_length()))}
        self.kind = execution.kind

    def block_load(self, size: int, gids) -> float:
        """Per-rank cost of one block (``Schedule.block_cost``)."""
        by = self.by_gid
        return sum(by[g].own if by[g].cp == size else by[g].cost(size) for g in gids) + self.overhead[size]

    def time(self, rows: list[Blocks]) -> float:
        if self.kind == "independent":
            return self._independent(rows)
        if self.kind == "synchronous":
            return self._synchronous(rows)
        return self._simulated(rows)

    def _synchronous(self, rows: list[Blocks]) -> float:
        """``sum(max(block_load))`` over rows, ``block_load``'s arithmetic inlined (the judge of every candidate)."""
        by, over, total = self.by_gid, self.overhead, 0.0
        for row in rows:
            worst = None
            for size, gids in row:
                t = 0
                for g in gids:
                    it = by[g]
                    t += it.own if it.cp == size else it.cost(size)
                t += over[size]
                if worst is None or t > worst:
                    worst = t
            total += worst
        return total

    def _independent(self, rows: list[Blocks]) -> float:
        free = [0.0] * self.n
        for row in rows:
            pos = 0
            for size, gids in row:
                dur = self.block_load(size, gids)
                if size == 1:
                    free[pos] += dur
                else:
                    t = max(free[pos:pos + size]) + dur
                    free[pos:pos + size] = [t] * size
                pos += size
        return max(free, default=0.0)

    def _simulated(self, rows: list[Blocks]) -> float:
        lengths = {g: it.raw for g, it in self.by_gid.items()}
        s = Schedule(tuple(layout_from_sizes(r) for r in rows), lengths, self.n, self.mslpr, self.min_cp,
                     self.vpp, "balanced", self.cost, self.execution)
        return simulate_execution(s, self.cost, self.execution).step_time

    def feasible(self, rows: list[Blocks]) -> bool:
        """Micro-batch count a multiple of the VPP group, and every sequence in a block of at least its ``cp_min``
        (the candidates guarantee the other invariants; a candidate that packs by a micro-batch capacity above
        ``max_seqlen_per_rank`` must not narrow a sequence below it)."""
        if not rows or (self.vpp and len(rows) % self.vpp):
            return False
        by = self.by_gid
        return all(size >= by[g].cp for row in rows for size, gids in row for g in gids)
