"""Rows balanced per micro-batch: every block of every micro-batch near the same per-rank load.

For the synchronous execution model (a barrier after every micro-batch) a step costs the sum over
micro-batches of the slowest rank, so a micro-batch must be balanced on its own; the phased plans
(``phased``) balance only the ranks' totals. Two pieces:

* ``lpt_rows(items, n, mslpr, leaf, rows_n, cost)``: ``rows_n`` micro-batches at a per-rank target
  ``T = area / (n x rows_n)``. A sequence whose per-rank cost at its ``cp_min`` exceeds ``theta x T`` is
  widened while that lowers it. Sequences of each width ``w`` wider than ``leaf`` get
  ``ceil(area_w / (w x T))`` blocks of ``w`` ranks (at least what their tokens need, at most one per
  sequence; with ``alone``, one more per sequence over half the target, which then runs alone in its
  block unless smaller ones fill it up); the ranks left become ``leaf`` blocks (at most one per sequence
  of that width; free ranks left at the end double the costliest blocks of their micro-batch). Sequences then go, widest first and by decreasing cost
  (LPT), to the block of their width or wider whose per-rank load after it is least (ties: the narrower
  block, then the first made), among blocks with room for their tokens; an empty block at the end borrows
  the shortest sequence of the block holding the most. Blocks are laid into rows first fit by decreasing
  (size, load): power-of-two sizes in decreasing order are buddy aligned and tile every row.
* ``rewiden(rows, ...)``: per row, every block shrunk to the least size its sequences allow, then the free
  ranks given to the block of the highest per-rank load that fits (doubling it), until none is free; the row
  is kept if its slowest block got faster. Megatron's rows (``megatron-dev``) double the leftmost smallest
  block instead.
"""

from __future__ import annotations

import heapq
import math

from harness.plan.balanced.items import Item
from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks

SCAN = 16


def _least_size(its: list[Item], leaf: int, mslpr: int) -> int:
    s = max(leaf, max(it.cp for it in its))
    tokens = sum(it.L for it in its)
    while s * mslpr < tokens:
        s *= 2
    return s


def lpt_rows(items: list[Item], n: int, mslpr: int, leaf: int, rows_n: int, cost: CostModel,
             theta: float = 1.0, alone: bool = False) -> list[Blocks] | None:
    """``rows_n`` micro-batches balanced per block (module doc), or None when they cannot hold the batch."""
    if rows_n < 1 or not items:
        return None
    target = sum(it.own * it.cp for it in items) / (n * rows_n)
    width, cost_at, area, tokens, count = {}, {}, {}, {}, {}
    for it in items:
        w, c = it.cp, it.own
        while w < n and c > theta * target:
            wider = it.cost(2 * w)
            if not wider < c:
                break
            w, c = 2 * w, wider
        width[it.gid], cost_at[it.gid] = w, c
        area[w] = area.get(w, 0.0) + w * c
        tokens[w] = tokens.get(w, 0) + it.L
        count[w] = count.get(w, 0) + 1
    target = sum(area.values()) / (n * rows_n)
    big: dict[int, list[float]] = {}  # per width, the costs over half the target: one block each
    for it in items:
        if alone and cost_at[it.gid] > target / 2:
            big.setdefault(width[it.gid], []).append(cost_at[it.gid])
    blocks: list[list] = []  # [size, per-rank load, room, items]
    for w in sorted(area, reverse=True):
        if w > leaf:
            rest = area[w] / w - sum(big.get(w, ()))
            need = len(big.get(w, ())) + (math.ceil(rest / target - 1e-9) if target > 0 and rest > 0 else 0)
            need = max(need, -(-tokens[w] // (w * mslpr)))
            blocks += [[w, 0.0, w * mslpr, []] for _ in range(min(need, count[w]))]
    used = sum(b[0] for b in blocks)
    if used > n * rows_n:
        return None
    blocks += [[leaf, 0.0, leaf * mslpr, []] for _ in range(min((n * rows_n - used) // leaf, count.get(leaf, 0)))]
    if not blocks:
        return None
    sizes = sorted({b[0] for b in blocks})
    heaps: dict[int, list[tuple[float, int]]] = {s: [] for s in sizes}
    for k, b in enumerate(blocks):
        heaps[b[0]].append((0.0, k))
    order = sorted(items, key=lambda it: (-width[it.gid], -cost_at[it.gid], it.gid))
    floor = [0] * len(order)  # the shortest sequence still to place: blocks with less room are full
    least = order[-1].L
    for i in range(len(order) - 1, -1, -1):
        least = floor[i] = min(least, order[i].L)
    for i, it in enumerate(order):
        best = None
        for s in sizes:
            if s >= width[it.gid]:
                k = _least_with_room(heaps[s], blocks, it.L, floor[i])
                if k is not None:
                    c = it.own if s == it.cp else it.cost(s)
                    if best is None or blocks[k][1] + c < best[0]:
                        best = (blocks[k][1] + c, k, c)
        if best is None:
            return None
        _, k, c = best
        b = blocks[k]
        b[1] += c
        b[2] -= it.L
        b[3].append(it)
        heapq.heappush(heaps[b[0]], (b[1], k))  # the old entry is stale now: ``_least_with_room`` drops it
    if not _lend_empty(blocks):
        return None
    rows: list[list[list]] = [[] for _ in range(rows_n)]
    free = [n] * rows_n
    for k in sorted(range(len(blocks)), key=lambda k: (-blocks[k][0], -blocks[k][1], k)):
        size = blocks[k][0]
        r = next((r for r in range(rows_n) if free[r] >= size), None)
        if r is None:
            return None
        free[r] -= size
        rows[r].append([size, blocks[k][1], blocks[k][3]])
    out = []
    for row, f in zip(rows, free):
        if not row:
            return None
        out.append(_filled(row, f, cost))
    return out


def _filled(row: list[list], free: int, cost: CostModel) -> Blocks:
    """A row of ``[size, load, items]`` blocks with ``free`` ranks left: the block of the highest load that
    fits the free ranks doubles (ties: the first) until none is free; laid out by decreasing size."""
    heap = [(-b[1], k) for k, b in enumerate(row)]
    heapq.heapify(heap)
    while free > 0:  # a block too wide for the free ranks stays so: they only shrink
        _, k = heapq.heappop(heap)
        b = row[k]
        if b[0] > free:
            continue
        free -= b[0]
        b[0] *= 2
        b[1] = sum(it.cost(b[0]) for it in b[2]) + cost.block_overhead(b[0])
        heapq.heappush(heap, (-b[1], k))
    order = sorted(range(len(row)), key=lambda k: (-row[k][0], k))
    return [(row[k][0], [it.gid for it in row[k][2]]) for k in order]


def spread_rows(items: list[Item], n: int, mslpr: int, leaf: int, rows_n: int,
                cost: CostModel) -> list[Blocks] | None:
    """Few sequences per rank: sequences to ``rows_n`` micro-batches by decreasing area, each to the one of
    least area with room for it (a sequence wider than ``leaf`` needs its ``cp_min`` ranks, a narrower one
    its share of a rank's tokens); per micro-batch, each sequence a block of its ``cp_min``, the two
    least loaded blocks of one size merged (the pair of least merged load, ties: the wider) while the
    blocks need more than ``n`` ranks, then the free ranks doubled onto the costliest blocks."""
    if rows_n < 1 or not items:
        return None
    heap = [(0.0, r) for r in range(rows_n)]
    ranks, members = [0.0] * rows_n, [[] for _ in range(rows_n)]
    for it in sorted(items, key=lambda it: (-it.own * it.cp, it.gid)):
        need = it.cp if it.cp > leaf else it.L / mslpr  # wide sequences rarely share a block
        held = []
        while heap and ranks[heap[0][1]] + need > n:
            held.append(heapq.heappop(heap))
        if not heap:
            return None
        area, r = heapq.heappop(heap)
        heapq.heappush(heap, (area + it.own * it.cp, r))
        for e in held:
            heapq.heappush(heap, e)
        ranks[r] += need
        members[r].append(it)
    out = []
    for its in members:
        row = _merged(its, n, mslpr, leaf, cost)
        if row is None:
            return None
        out.append(_filled(row, n - sum(b[0] for b in row), cost))
    return out


def _merged(its: list[Item], n: int, mslpr: int, leaf: int, cost: CostModel) -> list[list] | None:
    """``[size, load, items]`` blocks of ``its`` on at most ``n`` ranks (``spread_rows``), or None."""
    if not its:
        return None
    heaps: dict[int, list] = {}
    used, serial = 0, 0
    for it in its:
        s = max(it.cp, leaf)
        heaps.setdefault(s, []).append((it.cost(s) + cost.block_overhead(s), serial, it.L, [it]))
        serial += 1
        used += s
    for h in heaps.values():
        heapq.heapify(h)
    while used > n:
        best = None
        for s, h in heaps.items():
            if len(h) < 2:
                continue
            a, b = heapq.nsmallest(2, h)
            if a[2] + b[2] > s * mslpr:
                continue
            merged = a[0] + b[0] - cost.block_overhead(s)
            if best is None or (merged, -s) < (best[0], -best[1]):
                best = (merged, s)
        if best is None:
            return None
        merged, s = best
        h = heaps[s]
        a, b = heapq.heappop(h), heapq.heappop(h)
        heapq.heappush(h, (merged, serial, a[2] + b[2], a[3] + b[3]))
        serial += 1
        used -= s
    return [[s, load, list(group)] for s, h in sorted(heaps.items(), reverse=True) for load, _, _, group in sorted(h)]


def _least_with_room(heap: list[tuple[float, int]], blocks: list[list], L: int, floor: int) -> int | None:
    """The block of least load (then index) in ``heap`` with room for ``L`` tokens; stale entries (a load
    that is no longer the block's) and full blocks (room below ``floor``) are dropped on the way; None after
    ``SCAN`` blocks without room (a near-full batch would otherwise scan most blocks per sequence)."""
    held, found = [], None
    while heap:
        load, k = heap[0]
        if load != blocks[k][1] or blocks[k][2] < floor:
            heapq.heappop(heap)
        elif blocks[k][2] >= L:
            found = k
            break
        elif len(held) == SCAN:
            break
        else:
            held.append(heapq.heappop(heap))
    for e in held:
        heapq.heappush(heap, e)
    return found


def _lend_empty(blocks: list[list]) -> bool:
    """Give every empty block the shortest sequence it can run from the block holding the most (ties: the
    first); False if one stays empty."""
    for b in blocks:
        if b[3]:
            continue
        donor, most = None, 1
        for d in blocks:
            if len(d[3]) > most and any(x.cp <= b[0] and x.L <= b[2] for x in d[3]):
                donor, most = d, len(d[3])
        if donor is None:
            return False
        x = min((x for x in donor[3] if x.cp <= b[0] and x.L <= b[2]), key=lambda x: (x.L, x.gid))
        donor[3].remove(x)
        donor[2] += x.L
        donor[1] -= x.cost(donor[0])
        b[3].append(x)
        b[2] -= x.L
        b[1] += x.cost(b[0])
    return True


def rewiden(rows: list[Blocks], by_gid: dict[int, Item], n: int, mslpr: int, leaf: int,
            cost: CostModel) -> list[Blocks]:
    """``rows`` with each row's blocks re-sized to lower its slowest block (module doc)."""
    out = []
    for row in rows:
        before = max(sum(by_gid[g].cost(s) for g in gids) + cost.block_overhead(s) for s, gids in row)
        blocks = []
        for _, gids in row:
            its = [by_gid[g] for g in gids]
            s = _least_size(its, leaf, mslpr)
            blocks.append([s, sum(it.cost(s) for it in its) + cost.block_overhead(s), its])
        free = n - sum(b[0] for b in blocks)
        new = _filled(blocks, free, cost) if free >= 0 else row
        if free >= 0 and max(b[1] for b in blocks) < before:
            out.append(new)
        else:
            out.append(row)
    return out
