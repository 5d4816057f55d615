"""Rows by levels, for barriers: sequences at their ``cp_min``, each micro-batch filled up to one level.

Under the synchronous model a micro-batch costs its slowest rank, so a micro-batch should hold blocks of
about one per-rank load. ``lpt_rows`` gets there by widening the heavy sequences to one target, and pays the
K/V exchange of every widened sequence (~20% more per token at CP 4, ~45% at CP 8 under the GPT cost); here
no sequence is widened (with ``cap``, only those whose per-rank load exceeds it, while that lowers it): the
micro-batches are built one after the other, as a level packing does, each at the *level* of the costliest
sequence left (per-rank load at its size), or at the mean per-rank load of the rest over the micro-batches
their tokens still need when that is higher, and with no level at all for the last micro-batch they need:

* the sequences wider than ``leaf``, by decreasing per-rank load, join the least loaded block of their size
  in the micro-batch with room for their tokens, if it stays at or below the level, else open one while
  ranks are free;
* the free ranks become ``leaf`` blocks; the narrow sequences, by decreasing load, go to the least loaded
  of them with room, if it stays at or below the level, else to such a wide block of the micro-batch (the
  narrowest size first), else wait for a later micro-batch;
* then, per micro-batch, ``_even`` swaps sequences between its most loaded ``leaf`` block and the
  ``PARTNERS`` least loaded ones while that lowers the most loaded, within ``MOVES_PER_SEQUENCE`` steps per
  sequence in all (at most ``MOVES_MAX``); free ranks left double the costliest blocks (``rows._filled``).

So the heaviest sequences share the first micro-batch and the lightest the last ones, and every micro-batch
is near its level on most ranks (under the GPT cost, lognormal mean 1024, 2048 tokens per rank: 1.050 of the
lower bound at 64 ranks x 512 sequences, 1.038 at 1024 x 8192 and 1.039 at 4096 x 32768, where ``lpt_rows``
gives 1.17 / 1.17 / 1.19).

Work: each pool (``_Pool``) finds the least loaded block with room exactly, with the blocks short of room
for the current sequence set aside by room (rooms only fall, loads only rise), and after a sequence that
found no block, ``_next_candidate`` skips by bisection the ones that cannot find one either; so a
micro-batch costs O(sequences placed x log ranks) plus O(log sequences) per skip, not a scan of every
sequence left (~30 ms at 1024 ranks x 8192 sequences, ~170 ms at 4096 x 32768 on the CPU machine).
"""

from __future__ import annotations

import bisect
import heapq

from harness.plan.balanced.items import Item
from harness.plan.balanced.rows import _filled
from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks

MOVES_PER_SEQUENCE, MOVES_MAX = 16, 32_768
"""``_even``'s budget: this many candidate swaps (and slot scans) per sequence, over all micro-batches, and at
most ``MOVES_MAX`` in all (at scale the swaps gain little: 1.0382 against 1.0373 of the bound at 1024 ranks x
8192 sequences, for a third of the time)."""

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
    key = {it.gid: (-load[it.gid] - cost.block_overhead(size[it.gid]), it.gid) for it in items}
    order = sorted(items, key=lambda it: key[it.gid])
    wide = [it for it in order if size[it.gid] != leaf]
    narrow = [(it, it.L, load[it.gid]) for it in order if size[it.gid] == leaf]  # (sequence, tokens, load)
    rows: list[list[list]] = []
    area = sum(size[g] * load[g] for g in load)
    tokens = sum(it.L for it in items)
    while wide or narrow:
        first = min(wide[:1] + [x[0] for x in narrow[:1]], key=lambda it: key[it.gid])
        need = -(-tokens // (n * mslpr))  # micro-batches the tokens left need
        level = max(load[first.gid], area / (n * need)) + cost.block_overhead(size[first.gid])
        if need == 1:  # the last micro-batch the tokens need: every sequence that has room joins it
            level = float("inf")
        row, wide, narrow = _level_row(wide, narrow, level, size, load, n, mslpr, leaf, cost)
        if not row:
            return None
        rows.append(row)
        for b in row:
            for it in b[3]:
                area -= size[it.gid] * load[it.gid]
                tokens -= it.L
    budget = min(MOVES_PER_SEQUENCE * len(items), MOVES_MAX)
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


def _level_row(wide: list[Item], narrow: list[tuple], level: float, size: dict, load: dict, n: int, mslpr: int,
               leaf: int, cost: CostModel) -> tuple[list[list], list[Item], list[tuple]]:
    """(``[size, load, room, items]`` blocks of one micro-batch at ``level``, the wide sequences and the narrow
    ``(sequence, tokens, load)`` left for later, each still by decreasing load)."""
    free = n
    # without a level a sequence waits only for want of room (rare): no skipping, no tracking
    track = level < float("inf") and _skips(cost, leaf)
    pools: dict[int, _Pool] = {}
    # rooms below the shortest narrow sequence take none (``narrow`` ends with it when loads grow with tokens)
    floor = (narrow[-1][1] if _skips(cost, leaf) else min(x[1] for x in narrow)) if narrow else 0
    wide_rest = []
    for it in wide:
        s = size[it.gid]
        pool = pools.get(s) or pools.setdefault(s, _Pool(s, cost.block_overhead(s), s * mslpr, 0, track))
        k = pool.least_fitting(it.L, load[it.gid], level)
        top = k is not None
        if k is None:
            if free < s:
                wide_rest.append(it)
                continue
            k = pool.open()
            free -= s
        pool.add(k, it, it.L, load[it.gid], top)
    leaves = _Pool(leaf, cost.block_overhead(leaf), leaf * mslpr, floor, track)
    leaves.open_many(free // leaf)
    for pool in pools.values():
        pool.floor = floor
    sizes = sorted(pools)
    options = [(leaf, leaves)] + [(w, pools[w]) for w in sizes]
    taken = [False] * len(narrow)
    heap, wait, loads, rooms = leaves.heap, leaves.waiting, leaves.loads, leaves.rooms
    bl, br, bi = leaves.load, leaves.room, leaves.items
    heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
    i, count = 0, len(narrow)
    while i < count:
        it, L, c = narrow[i]
        if wait and -wait[0][0] >= L:
            leaves._admit(L)
        while heap:  # ``leaves.least_fitting`` and ``add`` inlined: most sequences go to a leaf block
            ld, k = heap[0]
            if ld != bl[k]:
                heappop(heap)
            elif br[k] < L:
                heappop(heap)
                leaves._wait(k)
            else:
                break
        i += 1
        if heap and heap[0][0] + c <= level:
            k = heap[0][1]
            ld = bl[k] + c
            bl[k] = ld
            room = br[k] - L
            br[k] = room
            bi[k].append(it)
            heapreplace(heap, (ld, k))
            if track:
                heappush(loads, (ld, k))
                heappush(rooms, (-room, k))
            taken[i - 1] = True
            continue
        for w, pool in options[1:]:  # else the narrowest wide block that stays at or below the level
            c = it.cost(w)
            k = pool.least_fitting(L, c, level)
            if k is not None:
                pool.add(k, it, L, c, top=True)
                taken[i - 1] = True
                break
        else:
            i = _next_candidate(narrow, i, options, level, leaf)
    row = [b for s in sizes for b in pools[s].blocks()] + [b for b in leaves.blocks() if b[3]]
    return row, wide_rest, [x for x, t in zip(narrow, taken) if not t]


def _next_candidate(narrow: list[tuple], i: int, options: list, level: float, leaf: int) -> int:
    """The first index from ``i`` of a narrow sequence that some pool may take: one with room for its tokens
    (``max_room``) and a block that stays at or below ``level`` with its load (``least_load``). ``narrow`` is by
    decreasing load, and with a per-rank load that grows with the tokens (``_skips``) by decreasing tokens and
    load at every size: the sequences a pool cannot take are a prefix of the rest, and the sequences skipped
    would have found no block (their loads and rooms only tighten), so the rows are those of trying each in
    turn."""
    if i >= len(narrow) or not options[0][1].track:
        return i
    first = len(narrow)
    for w, pool in options:
        room, slack = pool.max_room(), level - pool.least_load()
        if room <= 0 or slack < 0:
            continue
        cost = (lambda x: x[2]) if w == leaf else (lambda x, w=w: x[0].cost(w))
        if narrow[i][1] <= room and cost(narrow[i]) <= slack:
            return i
        j = bisect.bisect_left(narrow, True, lo=i, hi=first, key=lambda x: x[1] <= room and cost(x) <= slack)
        first = min(first, j)
    return first


def _skips(cost: CostModel, leaf: int) -> bool:
    """Whether a sequence's per-rank load at every size grows strictly with its tokens (then ``narrow`` is by
    decreasing tokens too, and ``_next_candidate`` may skip; a cost of constants alone keeps every sequence)."""
    return cost.quadratic > 0 or cost.linear > 0 or (cost.cp_comm > 0 and leaf > 1)


class _Pool:
    """Blocks of one size, in columns (``load``, ``room``, ``items`` per block): those with room for the current
    sequence in a heap by load, the others in a heap by room (a block moves back when a shorter sequence
    comes). Loads only rise and rooms only fall, so every entry is checked against its block when it surfaces
    (stale ones leave)."""

    def __init__(self, size: int, overhead: float, room: int, floor: int, track: bool = True):
        self.size, self.overhead, self.room0 = size, overhead, room  # every block opens with these
        self.load: list[float] = []
        self.room: list[int] = []
        self.items: list[list[Item]] = []
        self.track = track  # keep ``loads`` and ``rooms`` (a micro-batch without a level needs neither)
        self.loads: list[tuple[float, int]] = []  # (load, block) of every block, for ``least_load``
        self.rooms: list[tuple[int, int]] = []  # (-room, block) of every block, for ``max_room``
        self.heap: list[tuple[float, int]] = []  # (load, block): room >= the last sequence's tokens
        self.waiting: list[tuple[int, int]] = []  # (-room, block): too little room for the last sequence
        self.floor = floor

    def open(self) -> int:
        k = len(self.load)
        self.load.append(self.overhead)
        self.room.append(self.room0)
        self.items.append([])
        heapq.heappush(self.heap, (self.overhead, k))
        if self.track:
            heapq.heappush(self.loads, (self.overhead, k))
            heapq.heappush(self.rooms, (-self.room0, k))
        return k

    def open_many(self, count: int) -> None:
        """``count`` blocks into an empty pool (equal keys in index order are heaps already)."""
        assert not self.load, "open_many fills an empty pool"
        self.load = [self.overhead] * count
        self.room = [self.room0] * count
        self.items = [[] for _ in range(count)]
        self.heap = [(self.overhead, k) for k in range(count)]
        if self.track:
            self.loads = list(self.heap)
            self.rooms = [(-self.room0, k) for k in range(count)]

    def add(self, k: int, it: Item, L: int, c: float, top: bool = False) -> None:
        """Add ``it`` (``L`` tokens, load ``c``) to block ``k``; ``top``: ``k`` came from ``least_fitting``, still
        atop the heap."""
        ld = self.load[k] + c
        self.load[k] = ld
        room = self.room[k] - L
        self.room[k] = room
        self.items[k].append(it)
        if top:
            heapq.heapreplace(self.heap, (ld, k))
        else:
            heapq.heappush(self.heap, (ld, k))
        if self.track:
            heapq.heappush(self.loads, (ld, k))
            heapq.heappush(self.rooms, (-room, k))

    def blocks(self) -> list[list]:
        """``[size, load, room, items]`` per block, in the order opened."""
        return [[self.size, ld, r, its] for ld, r, its in zip(self.load, self.room, self.items)]

    def max_room(self) -> int:
        """The most tokens a block has room for (0 when none has room for ``floor``)."""
        rooms, room = self.rooms, self.room
        while rooms and -rooms[0][0] != room[rooms[0][1]]:
            heapq.heappop(rooms)
        return -rooms[0][0] if rooms and -rooms[0][0] >= self.floor else 0

    def least_load(self) -> float:
        """The least load of a block that can still take a sequence (inf when none can)."""
        loads, load, room = self.loads, self.load, self.room
        while loads:
            ld, k = loads[0]
            if ld == load[k] and room[k] >= self.floor:
                return ld
            heapq.heappop(loads)
        return float("inf")

    def least_fitting(self, L: int, c: float, level: float) -> int | None:
        """The least loaded block (then index) with room for ``L`` tokens, left atop the heap, if it stays at or
        below ``level`` with ``c`` more; else None. Blocks with room below ``floor`` leave for good."""
        L = max(L, self.floor)
        self._admit(L)
        heap, load, room = self.heap, self.load, self.room
        while heap:
            ld, k = heap[0]
            if ld != load[k]:
                heapq.heappop(heap)
                continue
            if room[k] < L:
                heapq.heappop(heap)
                self._wait(k)
                continue
            if ld + c > level:
                return None
            return k
        return None

    def _wait(self, k: int) -> None:
        room = self.room[k]
        if room >= self.floor:
            heapq.heappush(self.waiting, (-room, k))

    def _admit(self, L: int) -> None:
        """Move the waiting blocks with room for ``L`` tokens back to the heap by load."""
        waiting, load, room = self.waiting, self.load, self.room
        while waiting and -waiting[0][0] >= L:
            r, k = heapq.heappop(waiting)
            if -r == room[k]:
                heapq.heappush(self.heap, (load[k], k))
