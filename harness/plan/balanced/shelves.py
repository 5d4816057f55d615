"""Rows by shelves, for barriers where a micro-batch may hold many sequences per rank.

A stack that runs every sequence of a micro-batch as its own forward and backward (megatron-core's hybrid CP)
bounds each sequence by ``max_seqlen_per_rank`` (its ``cp_min``) but not a micro-batch: a rank may hold many
sequences of one micro-batch (``microbatch_tokens_per_rank`` above ``max_seqlen_per_rank``). There a sequence
costs every rank of its block a fixed overhead (``CostModel.per_sequence``) far above its compute, so a
widened sequence costs more ranks, and every barrier costs the micro-batch's slowest rank: the fewer
micro-batches, and the more even their ranks, the shorter the step. ``rows by levels`` fills each micro-batch
up to the level of its costliest sequence and puts every sequence left into the last one, whose blocks are
then as wide as its widest sequence: the wrong shape there. Shelves give each size its own micro-batches:

* the sequences of ``cp_min`` = s (``leaf`` at least), by decreasing load, go to the least loaded of the
  ``n / s`` blocks of size s of the shelf's micro-batches that has room (as few micro-batches as their tokens
  allow, one more while a sequence finds no room);
* widest shelves first: each block of a shelf wider than ``leaf`` takes narrower sequences, widened to its
  size, while they fit under the shelf micro-batch's slowest block and its room (the costliest first: every
  sequence taken is one less on the narrow shelves, at no cost to the wide one's micro-batch);
* ranks no block of a micro-batch uses double its costliest blocks (``rows._filled``).

With sequences of three sizes that is three micro-batches, each near the mean per-rank count of its size:
megatron-core's own scheduler's shape, balanced by the calibrated cost. Replayed on the default step workload's
measured batches under megatron-core's calibrated cost (4 x H200) they come within 0-4.7% of the lower bound,
megatron-core's own schedules within 0-8%.

Work: O(log blocks) per sequence (a heap of blocks by load, those short of room for the current sequence aside in
a heap by room until a shorter one comes; the narrow sequences taken found past by a union-find), plus a restart
with one more micro-batch when a sequence finds no room. ``balanced`` builds them up to ``EXTRA_MAX_SEQUENCES``
sequences, and at any size with a capacity above ``max_seqlen_per_rank`` (``balanced.SHELVES``).
"""

from __future__ import annotations

import bisect
import heapq

from harness.plan.balanced.items import Item
from harness.plan.balanced.rows import _filled
from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks


def shelf_rows(items: list[Item], n: int, cap: int, leaf: int, cost: CostModel) -> list[Blocks] | None:
    """Micro-batches by shelves (module doc); ``cap``: tokens a rank may hold in one micro-batch."""
    if not items:
        return None
    by_size: dict[int, list[Item]] = {}
    for it in items:
        by_size.setdefault(max(it.cp, leaf), []).append(it)
    narrow = _Narrow(by_size.get(leaf, []))
    rows: list[list[list]] = []  # blocks as [size, load, items, room]
    for s in sorted(by_size, reverse=True):
        if s == leaf:
            break
        shelf = _shelf(by_size[s], n, s, cap, cost)
        for row in shelf:
            _top_up(narrow, row)
        rows += shelf
    rest = narrow.left()
    if rest:
        rows += _shelf(rest, n, leaf, cap, cost)
    out = []
    for row in rows:
        blocks = [[b[0], b[1], b[2]] for b in row if b[2]]
        if blocks:
            out.append(_filled(blocks, n - sum(b[0] for b in blocks), cost))
    return out or None


def _shelf(items: list[Item], n: int, s: int, cap: int, cost: CostModel) -> list[list[list]]:
    """The sequences of one size on as few micro-batches of ``n // s`` blocks of size ``s`` as their tokens allow,
    each (by decreasing load) to the least loaded block with room. Blocks short of room for the current sequence
    wait aside (a heap by room) until a shorter one comes: a sequence costs O(log blocks) amortised."""
    order = sorted(items, key=lambda it: (-it.cost(s), it.gid))  # at one size: by decreasing length too
    over = cost.block_overhead(s)
    k = max(1, -(-sum(it.L for it in items) // (n * cap)))
    while True:
        blocks = [[s, over, [], s * cap] for _ in range(k * (n // s))]
        heap = [(over, j) for j in range(len(blocks))]  # (load, block) of the blocks with room for the current one
        aside: list[tuple[int, int]] = []  # (-room, block)
        ok = True
        for it in order:
            while aside and -aside[0][0] >= it.L:
                _, j = heapq.heappop(aside)
                heapq.heappush(heap, (blocks[j][1], j))
            while heap and blocks[heap[0][1]][3] < it.L:
                _, j = heapq.heappop(heap)
                heapq.heappush(aside, (-blocks[j][3], j))
            if not heap:
                ok = False
                break
            _, j = heapq.heappop(heap)
            b = blocks[j]
            b[1] += it.cost(s)
            b[2].append(it)
            b[3] -= it.L
            heapq.heappush(heap, (b[1], j))
        if ok:
            per = n // s
            return [blocks[r * per:(r + 1) * per] for r in range(k)]
        k += 1


class _Narrow:
    """The ``leaf``-size sequences not yet taken, by length: the longest one whose cost at a size fits a slack and
    whose tokens fit a room, in O(log) (a union-find over the taken ones skips them)."""

    def __init__(self, items: list[Item]):
        self.items = sorted(items, key=lambda it: (it.L, it.gid))
        self.lengths = [it.L for it in self.items]
        self.prev = list(range(len(self.items)))  # prev[k]: the largest untaken index <= k (path-compressed)
        self.taken: set[int] = set()

    def _find(self, k: int) -> int:
        root = k
        while root >= 0 and self.prev[root] != root:
            root = self.prev[root]
        while k >= 0 and self.prev[k] != k:  # compress
            self.prev[k], k = root, self.prev[k]
        return root

    def longest(self, most: int) -> int:
        """The index of the longest sequence not yet taken among the first ``most + 1`` (-1: none)."""
        return self._find(most)

    def take(self, k: int) -> Item:
        it = self.items[k]
        self.prev[k] = k - 1
        self.taken.add(it.gid)
        return it

    def left(self) -> list[Item]:
        return [it for it in self.items if it.gid not in self.taken]


def _pick(narrow: _Narrow, block: list, level: float) -> int:
    """The index in ``narrow`` of the longest sequence not yet taken whose cost at ``block``'s size fits under
    ``level`` and whose tokens fit the block's room (-1: none)."""
    room = bisect.bisect_right(narrow.lengths, block[3]) - 1
    fits = bisect.bisect_right(narrow.items, level - block[1], key=lambda it: it.cost(block[0])) - 1
    return narrow.longest(min(room, fits))


def _top_up(narrow: _Narrow, row: list[list]) -> None:
    """Fill the blocks of a wide shelf's micro-batch with ``narrow``'s sequences widened to their size, up to its
    slowest block and within each block's room (a sequence's per-rank cost at a fixed size grows with its length)."""
    if not narrow.items:
        return
    level = max(b[1] for b in row)
    for b in sorted(row, key=lambda b: b[1]):
        size = b[0]
        while True:
            k = _pick(narrow, b, level)
            if k < 0:
                break
            it = narrow.take(k)
            b[1] += it.cost(size)
            b[2].append(it)
            b[3] -= it.L
