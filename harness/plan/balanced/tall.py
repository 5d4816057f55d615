"""Rows led by one tall micro-batch, for barriers when the longest sequences dominate.

Under the synchronous model the step is the sum of the micro-batches' heights. When the longest sequences
cost a micro-batch's worth or more at their ``cp_min`` (quadratic attention), every micro-batch that holds
one must be tall or widen it, and widening pays its K/V exchange on every rank it adds. The rows by levels
(``levels.level_rows``) take the sequences by per-rank load, so a long sequence widened to the level looks
light and lands in a later micro-batch, which then has to be as tall as it. Here (the structure of
``harness.plan.tallest``'s bound) one micro-batch of height ``H`` takes the *longest* sequences first:

* each sequence wider than ``leaf``, longest first, runs at the narrowest size whose per-rank load fits
  ``H`` (``_size``) and joins the block, of that size or wider, where it fits most tightly (load and tokens),
  else opens a block of that size while ranks are free, else waits for the rows by levels;
* the free ranks left hold the longest narrow sequences as ``leaf`` blocks (each to the least loaded block
  with room, up to ``H``), and double the costliest blocks when nothing else fits (``rows._filled``);
* every sequence left is scheduled by ``level_rows`` at each widening cap of ``REST_CAPS``.

``H`` is tried at ``HEIGHTS`` times the mean per-micro-batch load of the least micro-batch count; the
``KEEP`` heights whose tall micro-batch leaves the least for the others (``H`` plus the rest's rank-time over
the ranks) go on to the rest. At 1024 ranks x 8192 sequences of lognormal mean 4096 (16384 tokens per rank)
under the GPT cost: 1.105 of the area bound where the rows by levels give 1.117 (seed 0; seeds 1 and 2:
1.144 and 1.125 against 1.143 and 1.132), ~0.13 s; at 4096 x 32768 of them quality 1.0505 against 1.0544
in +0.55 s (the whole plan 1.95 s); on 64 ranks x 512 such sequences they win about half the time. Only
tried when the rows by levels are not within ``SYNC_ENOUGH`` of the area bound.
"""

from __future__ import annotations

import bisect
import heapq

from harness.plan.balanced.items import Item
from harness.plan.balanced.levels import level_rows
from harness.plan.balanced.rows import _filled
from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks

HEIGHTS = (1.1, 1.15, 1.2, 1.25, 1.3)
"""Heights of the tall micro-batch tried, in means of the per-micro-batch load (area over the least count)."""
KEEP = 2
"""Heights whose rest is scheduled (the least ``H + rest / ranks`` first)."""
REST_CAPS = (1.15, 1.25, 1.4)
"""``level_rows`` widening caps for the rest, in means of its own per-micro-batch load."""


def _size(it: Item, lo: int, n: int, height: float, cost: CostModel) -> int | None:
    """Narrowest power-of-two size >= ``lo`` whose block of ``it`` alone fits ``height``, or None."""
    s = lo
    while s <= n:
        if it.cost(s) + cost.block_overhead(s) <= height:
            return s
        s *= 2
    return None


def _tightest(blocks: list[list], most: float, tokens: int) -> int:
    """Index of the most loaded of ``blocks`` (``[load, tiebreak, [size, load, items, room]]`` by load) whose
    load is at most ``most`` and whose room holds ``tokens``, or -1."""
    k = bisect.bisect_right(blocks, [most, float("inf")]) - 1
    while k >= 0 and blocks[k][2][3] < tokens:
        k -= 1
    return k


def tall_row(items: list[Item], n: int, mslpr: int, leaf: int, cost: CostModel,
             height: float) -> tuple[Blocks, set[int]]:
    """(the tall micro-batch at ``height``, the gids it holds): see the module doc."""
    free = n
    by_size: dict[int, list[list]] = {}  # size -> [load, tiebreak, block] sorted by load
    blocks: list[list] = []  # [size, load, items, room]
    held: set[int] = set()
    wide = sorted((it for it in items if it.cp > leaf), key=lambda it: (-it.L, it.gid))
    for it in wide:
        s0 = _size(it, max(it.cp, leaf), n, height, cost)
        if s0 is None:
            continue
        best = None  # (load after, size, index in its list)
        for s, lst in by_size.items():
            if s < s0:
                continue
            c = it.cost(s)
            k = _tightest(lst, height - c, it.L)
            if k >= 0 and (best is None or lst[k][0] + c > best[0]):
                best = (lst[k][0] + c, s, k)
        if best is None:
            if free < s0:
                continue
            free -= s0
            b = [s0, cost.block_overhead(s0), [], s0 * mslpr]
            blocks.append(b)
            entry = [b[1], len(blocks), b]
            bisect.insort(by_size.setdefault(s0, []), entry)
            best = (b[1] + it.cost(s0), s0, by_size[s0].index(entry))
        load, s, k = best
        entry = by_size[s].pop(k)
        b = entry[2]
        b[1], b[3] = load, b[3] - it.L
        b[2].append(it)
        held.add(it.gid)
        bisect.insort(by_size[s], [load, entry[1], b])
    if free:
        heap: list[tuple[float, int]] = []
        leaves: list[list] = []
        for it in sorted((it for it in items if it.cp <= leaf), key=lambda it: (-it.L, it.gid)):
            c = it.cost(leaf)
            skipped, spot = [], None
            while heap:  # least loaded leaf block with room
                ld, k = heapq.heappop(heap)
                if leaves[k][3] >= it.L:
                    spot = (ld, k)
                    break
                skipped.append((ld, k))
            for x in skipped:
                heapq.heappush(heap, x)
            if spot is not None and spot[0] + c > height:
                heapq.heappush(heap, spot)
                spot = None
            if spot is None:
                if free < leaf or cost.block_overhead(leaf) + c > height:
                    continue
                free -= leaf
                leaves.append([leaf, cost.block_overhead(leaf), [], leaf * mslpr])
                spot = (leaves[-1][1], len(leaves) - 1)
            b = leaves[spot[1]]
            b[1] += c
            b[3] -= it.L
            b[2].append(it)
            held.add(it.gid)
            heapq.heappush(heap, (b[1], spot[1]))
        blocks += leaves
    if not blocks:  # nothing fits under this height (a block's overhead alone may pass it): no row here
        return [], held
    return _filled([[b[0], b[1], b[2]] for b in blocks], free, cost), held


def tall_rows(items: list[Item], n: int, mslpr: int, leaf: int, cost: CostModel):
    """Rows of one tall micro-batch and the rest by levels (module doc), a generator of candidates."""
    least = -(-sum(it.L for it in items) // (n * mslpr))
    if least < 2 or not any(it.cp > leaf for it in items):
        return
    mean = sum(it.own * it.cp for it in items) / (n * least)
    tried = []
    for f in HEIGHTS:
        h = f * mean
        row, held = tall_row(items, n, mslpr, leaf, cost, h)
        if not held:
            continue
        rest = [it for it in items if it.gid not in held]
        tried.append((h + sum(it.own * it.cp for it in rest) / n, f, row, rest))
    tried.sort(key=lambda t: (t[0], t[1]))
    for _, _, row, rest in tried[:KEEP]:
        if not rest:
            yield [row]
            continue
        rest_least = -(-sum(it.L for it in rest) // (n * mslpr))
        rest_mean = sum(it.own * it.cp for it in rest) / (n * rest_least)
        for f in REST_CAPS:
            rows = level_rows(rest, n, mslpr, leaf, cost, f * rest_mean)
            if rows is not None:
                yield [row] + rows
