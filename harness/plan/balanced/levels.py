"""Rows by levels, for barriers: sequences at their ``cp_min``, each micro-batch filled up to one level.

Under the synchronous model a micro-batch costs its slowest rank, so a micro-batch should hold blocks of
about one per-rank load. ``lpt_rows`` gets there by widening the heavy sequences to one target, and pays the
K/V exchange of every widened sequence (~20% more per token at CP 4, ~45% at CP 8 under the GPT cost); here
no sequence is widened (with ``cap``, only those whose per-rank load exceeds it, while that lowers it): the
micro-batches are built one after the other, as a level packing does, each at the *level* of the costliest
sequence left (per-rank load at its size), or at the mean per-rank load of the rest over the micro-batches
their tokens still need when that is higher, and with no level at all for the last micro-batch they need:

* the sequences wider than ``leaf``, by decreasing per-rank load, join the least loaded block of their size
  in the micro-batch with room for their tokens that stays at or below the level (``SCAN`` tried), else
  open one while ranks are free;
* the free ranks become ``leaf`` blocks; the narrow sequences, by decreasing load, go to the least loaded
  of them with room that stays at or below the level (``SCAN`` tried), else to such a wide block of the
  micro-batch (the narrowest first), else wait for a later micro-batch;
* then, per micro-batch, ``_even`` swaps sequences between its most loaded ``leaf`` block and the
  ``PARTNERS`` least loaded ones while that lowers the most loaded, within ``MOVES_PER_SEQUENCE`` steps per
  sequence in all; free ranks left double the costliest blocks (``rows._filled``).

So the heaviest sequences share the first micro-batch and the lightest the last ones, and every micro-batch
is near its level on most ranks (at 64 ranks x 512 sequences, lognormal mean 1024, 2048 tokens per rank,
under the GPT cost: 1.050 of the lower bound, where ``lpt_rows`` gives 1.17). Work: O(sequences x
micro-batches x ``SCAN``), bounded by the input, never the clock.
"""

from __future__ import annotations

import bisect
import heapq

from harness.plan.balanced.items import Item
from harness.plan.balanced.rows import _filled
from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks

SCAN = 4
"""Blocks (least loaded first) a sequence tries before it waits for a later micro-batch."""

MOVES_PER_SEQUENCE = 16
"""``_even``'s budget: this many candidate swaps (and slot scans) per sequence, over all micro-batches."""

PARTNERS = 8
"""``_even`` pairs the most loaded ``leaf`` block with this many of the least loaded."""


def level_rows(items: list[Item], n: int, mslpr: int, leaf: int, cost: CostModel,
               cap: float | None = None) -> list[Blocks] | None:
    """Micro-batches by levels (module doc), or None when a micro-batch would hold nothing. With ``cap``,
    a sequence whose per-rank load exceeds it is first widened while that lowers its load."""
    size = {it.gid: max(it.cp, leaf) for it in items}
    load = {it.gid: it.own if it.cp >= leaf else it.cost(leaf) for it in items}
    if cap is not None:
        for it in items:
            w, c = size[it.gid], load[it.gid]
            while w < n and c > cap:
                wider = it.cost(2 * w)
                if not wider < c:
                    break
                w, c = 2 * w, wider
            size[it.gid], load[it.gid] = w, c
    left = sorted(items, key=lambda it: (-load[it.gid] - cost.block_overhead(size[it.gid]), it.gid))
    rows: list[list[list]] = []
    area = sum(size[g] * load[g] for g in load)
    tokens = sum(it.L for it in items)
    while left:
        first = left[0]
        need = -(-tokens // (n * mslpr))  # micro-batches the tokens left need
        level = max(load[first.gid], area / (n * need)) + cost.block_overhead(size[first.gid])
        if need == 1:  # the last micro-batch the tokens need: every sequence that has room joins it
            level = float("inf")
        row, rest = _level_row(left, level, size, load, n, mslpr, leaf, cost)
        if not row:
            return None
        rows.append(row)
        for b in row:
            for it in b[3]:
                area -= size[it.gid] * load[it.gid]
                tokens -= it.L
        left = rest
    budget = MOVES_PER_SEQUENCE * len(items)
    for row in rows:
        budget = _even(row, leaf, load, budget)
    return [_filled([[b[0], b[1], b[3]] for b in row], n - sum(b[0] for b in row), cost) for row in rows]


def _even(row: list[list], leaf: int, load: dict, budget: int) -> int:
    """Swap two sequences (or move one) between the most loaded ``leaf`` block of ``row`` and one of the
    ``PARTNERS`` least loaded (the swap that leaves the lower of the two maxima) while that lowers it and fits
    both blocks' rooms, and no wider block is slower; returns the budget left."""
    slots = [b for b in row if b[0] == leaf]
    wide = max((b[1] for b in row if b[0] != leaf), default=float("-inf"))
    order = sorted((b[1], k) for k, b in enumerate(slots))  # (load, slot) ascending
    while budget > 0 and len(order) > 1:
        ka = order[-1][1]
        a = slots[ka]
        if wide > a[1]:  # a wider block is the slowest: no swap of these lowers the row
            return budget
        best = None
        for _, kb in order[:PARTNERS]:
            b = slots[kb]
            gap = a[1] - b[1]
            for x in a[3]:
                cx = load[x.gid]
                for y in [None] + b[3]:
                    cy = 0.0 if y is None else load[y.gid]
                    d = cx - cy
                    ly = 0 if y is None else y.L
                    budget -= 1
                    if 0 < d < gap and b[2] + ly >= x.L and a[2] + x.L >= ly:
                        after = max(a[1] - d, b[1] + d)
                        if best is None or after < best[0]:
                            best = (after, kb, x, y, d, ly)
        if best is None:
            return budget
        _, kb, x, y, d, ly = best
        b = slots[kb]
        order.remove((a[1], ka))
        order.remove((b[1], kb))
        a[3].remove(x)
        b[3].append(x)
        if y is not None:
            b[3].remove(y)
            a[3].append(y)
        a[1] -= d
        b[1] += d
        a[2] += x.L - ly
        b[2] -= x.L - ly
        bisect.insort(order, (a[1], ka))
        bisect.insort(order, (b[1], kb))
    return budget


def _level_row(left: list[Item], level: float, size: dict, load: dict, n: int, mslpr: int, leaf: int,
               cost: CostModel) -> tuple[list[list], list[Item]]:
    """(``[size, load, items]`` blocks of one micro-batch at ``level``, the sequences left for later)."""
    free, placed = n, set()
    pools: dict[int, _Pool] = {}
    narrow = [it for it in left if size[it.gid] == leaf]
    floor = min((it.L for it in narrow), default=0)  # rooms below it take no narrow sequence
    for it in left:
        s = size[it.gid]
        if s == leaf:
            continue
        pool = pools.get(s) or pools.setdefault(s, _Pool(0))
        k = pool.least_fitting(it.L, load[it.gid], level)
        if k is None:
            if free < s:
                continue
            k = pool.open(s, cost.block_overhead(s), s * mslpr)
            free -= s
        pool.add(k, it, load[it.gid])
        placed.add(it.gid)
    leaves = _Pool(floor)
    for _ in range(free // leaf):
        leaves.open(leaf, cost.block_overhead(leaf), leaf * mslpr)
    for pool in pools.values():
        pool.floor = floor
    wide = sorted(pools)
    for it in narrow:
        c = load[it.gid]
        k = leaves.least_fitting(it.L, c, level)
        if k is not None:
            leaves.add(k, it, c)
            placed.add(it.gid)
            continue
        for w in wide:  # the narrowest wide block that stays at or below the level
            c = it.cost(w)
            k = pools[w].least_fitting(it.L, c, level)
            if k is not None:
                pools[w].add(k, it, c)
                placed.add(it.gid)
                break
    rest = [it for it in left if it.gid not in placed]
    row = [b for s in wide for b in pools[s].blocks] + [b for b in leaves.blocks if b[3]]
    return row, rest


class _Pool:
    """Blocks of one size, ``[size, load, room, items]``, in a heap by load, and a bound on the largest room."""

    def __init__(self, floor: int):
        self.blocks: list[list] = []
        self.heap: list[tuple[float, int]] = []
        self.floor, self.max_room, self.stale = floor, 0, False

    def open(self, size: int, overhead: float, room: int) -> int:
        self.blocks.append([size, overhead, room, []])
        heapq.heappush(self.heap, (overhead, len(self.blocks) - 1))
        self.max_room = max(self.max_room, room)
        return len(self.blocks) - 1

    def add(self, k: int, it: Item, c: float) -> None:
        b = self.blocks[k]
        if b[2] == self.max_room:
            self.stale = True
        b[1] += c
        b[2] -= it.L
        b[3].append(it)
        heapq.heappush(self.heap, (b[1], k))

    def least_fitting(self, L: int, c: float, level: float) -> int | None:
        """Pop and return the least loaded block (then index) with room for ``L`` tokens that stays at or
        below ``level`` with ``c`` more (``SCAN`` tried), or None; blocks with room below ``floor`` leave."""
        heap, blocks = self.heap, self.blocks
        if L > self.max_room:
            if not self.stale:
                return None
            self.max_room = max((blocks[k][2] for _, k in heap), default=0)
            self.stale = False
            if L > self.max_room:
                return None
        held, found = [], None
        while heap:
            load, k = heap[0]
            if blocks[k][2] < self.floor or load != blocks[k][1]:
                heapq.heappop(heap)
                continue
            if load + c > level:
                break
            if blocks[k][2] >= L:
                heapq.heappop(heap)
                found = k
                break
            if len(held) == SCAN:
                break
            held.append(heapq.heappop(heap))
        for e in held:
            heapq.heappush(heap, e)
        return found
