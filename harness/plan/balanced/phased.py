"""``balanced``'s phased plans: level-synchronous phases on the buddy tree, balanced per rank (see the
package doc, ``harness.plan.balanced``)."""

from __future__ import annotations

import heapq
from collections import Counter
from itertools import chain
from operator import attrgetter

from harness.plan.balanced.items import Infeasible, Item
from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks

THETAS = (0.5, 1.0)  # widen a sequence while its per-rank cost exceeds theta x the per-rank target


def split_to(packs: list[list[Item]], count: int) -> None:
    """Split packs (most sequences first, moving its last one out) until there are ``count``."""
    while len(packs) < count:
        lens = list(map(len, packs))
        k = lens.index(max(lens))
        assert len(packs[k]) > 1, "caller guarantees enough sequences"
        packs.append([packs[k].pop()])


def _size(packs: list[list[Item]]) -> int:
    return sum(len(p) for p in packs)


class PhasedBuilder:
    """Phased plans for one batch; ``plan(theta, leaf)`` builds one candidate."""

    def __init__(self, items, n: int, mslpr: int, min_cp: int, vpp: int | None, cost: CostModel):
        self.items, self.n, self.mslpr, self.min_cp, self.vpp, self.cost = items, n, mslpr, min_cp, vpp, cost
        area = {it: it.own * it.cp for it in items}
        self.target = sum(area.values()) / n
        # orders by a key, then gid: stable sorts of ``by_gid`` (``reverse=True`` keeps ties in gid order too)
        self.by_gid = sorted(items, key=attrgetter("gid"))
        self.pool = sorted(self.by_gid, key=area.__getitem__)  # filler order
        self.by_len = sorted(self.by_gid, key=attrgetter("L"), reverse=True)  # the packs' order
        self.cps = {it.gid: it.cp for it in items}  # the widths while no item is widened
        self.cp_count = Counter(self.cps.values())
        # per node size, computed once for all candidates: item -> cost, item -> LPT key (``_phase``),
        # and (sizes that are leaves) every item in LPT order
        self.costs: dict[int, dict[Item, float]] = {}
        self.keys: dict[int, dict[Item, float]] = {}
        self.orders: dict[int, list[Item]] = {}

    def widths(self, theta: float, leaf: int) -> dict[int, int]:
        """gid -> node size: cp_min, widened while too costly, at least ``leaf``, and promoted while
        a depth has more nodes than sequences to give them."""
        n, limit = self.n, theta * self.target
        width, count = dict(self.cps), dict(self.cp_count)
        # with every cp_min >= leaf, only the items over the limit at their cp_min can change
        for it in self.items if leaf > self.min_cp else [it for it in self.items if it.own > limit]:
            w = it.cp if it.cp >= leaf else leaf
            c = it.own if w == it.cp else it.cost(w)
            while w < n and c > limit:
                wider = it.cost(2 * w)
                if not wider < c:
                    break
                w, c = 2 * w, wider
            if w != it.cp:
                width[it.gid] = w
                count[it.cp] -= 1
                count[w] = count.get(w, 0) + 1
        s, below, promoted = leaf, 0, set()  # below: sequences on nodes smaller than s
        while s < n:
            at = count.get(s, 0)
            if at and below + at < n // s:
                if s == leaf:
                    raise Infeasible(f"fewer sequences than {n // s} leaves")
                promoted.add(s)
                count[2 * s] = count.get(2 * s, 0) + at
            else:
                below += at
            s *= 2
        if promoted:
            for g, w in width.items():
                while w in promoted:
                    w *= 2
                width[g] = w
        return width

    def _at(self, size: int, items) -> tuple[dict[Item, float], dict[Item, float]]:
        """(item -> ``cost(size)``, item -> LPT key), ``items`` added: the candidates share them."""
        costs, keys = self.costs.setdefault(size, {}), self.keys.setdefault(size, {})
        # LPT key: the sequence's cost plus its share of the block's fixed cost (``block_overhead``:
        # the fraction of a slot its tokens fill); without it, a model whose cost is mostly per micro-batch gives every
        # sequence ~0 and LPT piles them all onto node 0 (twice the micro-batches: measured on H200s)
        share = self.cost.block_overhead(size) / (size * self.mslpr)
        for it in items:
            if it not in costs:
                c = costs[it] = it.own if it.cp == size else it.cost(size)
                keys[it] = c + share * it.L
        return costs, keys

    def _lpt_order(self, size: int) -> list[Item]:
        """Every item by decreasing LPT key, then gid: a leaf phase takes those not yet placed."""
        order = self.orders.get(size)
        if order is None:
            _, keys = self._at(size, self.items)
            order = self.orders[size] = sorted(self.by_gid, key=keys.__getitem__, reverse=True)
        return order

    def plan(self, theta: float, leaf: int, width: dict[int, int] | None = None) -> tuple[list[Blocks], float]:
        """One candidate; ``width``: ``widths(theta, leaf)`` if the caller has it already."""
        width = self.widths(theta, leaf) if width is None else width
        by_width: dict[int, list[Item]] = {}
        for it, w in zip(self.items, width.values()):  # ``widths`` lists the items in order
            by_width.setdefault(w, []).append(it)
        self.taken: set[int] = set()
        taken = self.taken
        self.pool_pos = 0
        base, phases, depth = [0.0], [], 0
        while True:
            size, last = self.n >> depth, (self.n >> depth) == leaf
            if last:
                native = [it for it in self._lpt_order(size) if it.gid not in taken]
            else:
                native = [it for it in by_width.get(size, ()) if it.gid not in taken]
            if native:
                rows_before = sum(len(p[0]) for _, p in phases)
                node_packs, own = self._phase(native, size, base, last, rows_before)
                phases.append((size, node_packs))
                base = [b + o for b, o in zip(base, own)]
            if last:
                break
            base = [b for b in base for _ in (0, 1)]
            depth += 1
        if self.vpp:
            self._align_upper(phases)
        rows = [[(size, [it.gid for it in packs[r]]) for packs in node_packs]
                for size, node_packs in phases for r in range(len(node_packs[0]))]
        return rows, max(base) + sum(self.cost.block_overhead(row[0][0]) for row in rows)

    def _phase(self, native, size: int, base: list[float], last: bool, rows_before: int):
        """LPT of ``native`` (in LPT order if ``last``) onto the nodes of one depth, then an equal
        pack count per node."""
        nodes = len(base)
        node_of: dict[Item, int] = {}
        own = [0.0] * nodes
        heap = [(base[j], j) for j in range(nodes)]
        heapq.heapify(heap)
        if last:  # ``_lpt_order`` filled these; the leaf phase comes last: nothing to mark taken
            costs, keys = self.costs[size], self.keys[size]
        else:
            costs, keys = self._at(size, native)
            native = sorted(native, key=lambda it: (-keys[it], it.gid))
            self.taken.update(it.gid for it in native)
        for it in native:  # (load, node) pairs are distinct: replacing the least is pop then push
            load, j = heap[0]
            node_of[it] = j
            own[j] += costs[it]
            heapq.heapreplace(heap, (load + keys[it], j))
        # each node's sequences first-fit decreasing by tokens into packs of a slot's tokens
        packs: list[list[list[Item]]] = [[] for _ in range(nodes)]
        rooms: list[list[int]] = [[] for _ in range(nodes)]
        cap = size * self.mslpr
        for it in self.by_len if last else sorted(native, key=lambda x: (-x.L, x.gid)):
            j = node_of.get(it)
            if j is None:  # placed at an upper depth
                continue
            room, L = rooms[j], it.L
            for k, r in enumerate(room):
                if L <= r:
                    packs[j][k].append(it)
                    room[k] = r - L
                    break
            else:
                packs[j].append([it])
                room.append(cap - L)
        count = max(map(len, packs))
        held = [sum(map(len, node)) for node in packs]  # sequences per node
        if last and self.vpp:
            count += (-(rows_before + count)) % self.vpp
        for j in range(nodes):
            while held[j] < count:
                it = self._borrow(j, packs, held, count) if last else self._filler()
                packs[j].append([it])
                held[j] += 1
                own[j] += it.cost(size)
        for node in packs:
            if len(node) < count:
                split_to(node, count)
        if last:  # leaves lent sequences to each other: recount
            own = [sum(map(costs.__getitem__, chain.from_iterable(node))) for node in packs]
        return packs, own

    def _filler(self) -> Item:
        """The cheapest sequence not yet placed (it runs widened at this depth)."""
        while self.pool_pos < len(self.pool):
            it = self.pool[self.pool_pos]
            self.pool_pos += 1
            if it.gid not in self.taken:
                self.taken.add(it.gid)
                return it
        raise Infeasible("no sequence left to fill a node")

    @staticmethod
    def _borrow(j: int, packs: list[list[list[Item]]], held: list[int], count: int) -> Item:
        """The shortest sequence of the leaf (other than ``j``) with the most spare sequences
        (``held``: sequences per leaf, the donor's decremented here)."""
        others = held[:j] + held[j + 1:]
        if not others or max(others) <= count:
            raise Infeasible("leaves have too few sequences for equal micro-batch counts")
        donor = held.index(max(others))  # the first with the most: not j, which holds fewer than count
        held[donor] -= 1
        node = packs[donor]
        _, _, k, i = min((it.L, it.gid, k, i) for k, p in enumerate(node) for i, it in enumerate(p))
        it = node[k].pop(i)
        if not node[k]:
            node.pop(k)
        return it

    def _align_upper(self, phases) -> None:
        """If the total is still not a multiple of vpp (no leaf phase, or it could not absorb it),
        split packs of the finest phase whose nodes all have spare sequences."""
        need = (-sum(len(p[0]) for _, p in phases)) % self.vpp
        for _, node_packs in reversed(phases):
            while need and all(_size(p) > len(p) for p in node_packs):
                for p in node_packs:
                    split_to(p, len(p) + 1)
                need -= 1
        if need:
            raise Infeasible("no phase can be split further")
