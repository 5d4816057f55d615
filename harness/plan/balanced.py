"""``balanced``: our scheduler - level-synchronous phases on the buddy tree, balanced per rank.

Idea. Think of the N positions as a binary buddy tree: depth d has ``2**d`` nodes of ``N >> d``
consecutive positions, exactly the blocks that have dynamic-CP process groups. Every sequence gets
a node whose size is at least its ``cp_min`` (its native depth; a sequence too costly for one rank
set's share is widened to the smallest size that brings it under ``theta`` x the per-rank target).
The global batch then runs as *phases*, one per used depth, coarse to fine: phase d is ``P_d``
micro-batches whose layout is ``2**d`` blocks of ``N >> d`` positions, node j of depth d packing its
own sequences into its ``P_d`` slots.

Why this is fast in the simulated step time (and on GPUs): a phase never puts ranks of different
depth-d nodes into one block, and every rank of a node has run exactly the blocks of the node's
ancestors before, so no CP block ever waits for a straggler - a rank's step time is simply the sum
of its blocks. Imbalance between nodes can therefore carry over: each depth assigns its sequences
longest-processing-time first to the node with the least *inherited* load, and the finest ("leaf")
phase, where most sequences are, evens out the per-rank totals. Sequences stay at ``cp_min`` unless
a filler is needed, so the CP communication a cost model charges is the minimum.

Every layout is uniform, hence buddy aligned and non-increasing; capacity holds by construction
(first-fit-decreasing packs of ``size * max_seqlen_per_rank`` tokens). Equal micro-batch counts
inside a phase come from splitting packs; a node with fewer sequences than its phase's count
borrows the cheapest unassigned sequence (upper phases) or one from the leaf with the most spare
(leaf phase). When even that fails (small batches), the leaves are made coarser, down to a single
node of N positions. With ``vpp_group`` the leaf phase's count is chosen so that the total is a
multiple of it. Among the feasible candidates (``theta`` in ``THETAS``) the least predicted step time
wins; the prediction equals ``harness.plan.bounds.simulate_step_time`` (``plan_balanced`` returns it;
``suites/plan/test_invariants.py`` checks the equality for several cost models).
When the cost model charges per micro-batch (``per_microbatch > 0``, e.g. a cost model calibrated on
GPUs, where a launch-bound micro-batch costs ~40 ms whatever its tokens), two things change: LPT
charges each sequence its share of a micro-batch (its tokens over a slot's), and densely packed
rows (``_dense``: fewest micro-batches, blocks may wait; ``_tight``: the least possible number of
rows, ``ceil(tokens / (N x max_seqlen_per_rank))``, or one more, by minimum-bin-slack subset sums,
with the long sequences in as few rows as hold them - rank 0 pays ``cp_block`` in every row that
has a CP block) compete with the phased plans on predicted step time. Without that term, nothing
changes.
Deterministic: sequences are ordered by (cost, gid) and ties go to the lowest node index.

>>> from harness.plan.api import schedule
>>> s = schedule([8192, 4096, 3000, 2048, 1024, 1024, 512, 512, 256], n_ranks=8,
...              max_seqlen_per_rank=2048)
>>> s.microbatches  # 8192 widened to all 8 ranks, then a phase of four blocks of 2
[[[0], [0], [0], [0], [0], [0], [0], [0]], [[1], [1], [2], [2], [3], [3], [4, 5, 6, 7, 8], [4, 5, 6, 7, 8]]]
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import Counter
from itertools import chain
from operator import attrgetter

from harness.plan.binpack import min_bins
from harness.plan.cost import CostModel, cp_min
from harness.plan.errors import VPPAlignmentError
from harness.plan.megatron_common import Blocks

THETAS = (0.5, 1.0)  # widen a sequence while its per-rank cost exceeds theta x the per-rank target


class _Item:
    __slots__ = ("gid", "L", "cp", "work", "comm", "own")

    def __init__(self, gid: int, L: int, cp: int, cost: CostModel):
        self.gid, self.L, self.cp = gid, L, cp
        self.work = cost.quadratic * L * L + cost.linear * L + cost.constant
        self.comm = cost.cp_comm * L
        self.own = self.cost(cp)  # at its cp_min, where most plans run it

    def cost(self, s: int) -> float:
        """Same arithmetic as ``CostModel.seq_cost`` (so predictions match the simulator)."""
        return self.work / s + (self.comm * (s - 1) / s if s > 1 else 0.0)


class _Infeasible(Exception):
    """This candidate cannot give every node enough sequences; try a coarser one."""


def _split_to(packs: list[list[_Item]], count: int) -> None:
    """Split packs (most sequences first, moving its last one out) until there are ``count``."""
    while len(packs) < count:
        lens = list(map(len, packs))
        k = lens.index(max(lens))
        assert len(packs[k]) > 1, "caller guarantees enough sequences"
        packs.append([packs[k].pop()])


def _size(packs: list[list[_Item]]) -> int:
    return sum(len(p) for p in packs)


class _Builder:
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
        self.costs: dict[int, dict[_Item, float]] = {}
        self.keys: dict[int, dict[_Item, float]] = {}
        self.orders: dict[int, list[_Item]] = {}

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
                    raise _Infeasible(f"fewer sequences than {n // s} leaves")
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

    def _at(self, size: int, items) -> tuple[dict[_Item, float], dict[_Item, float]]:
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

    def _lpt_order(self, size: int) -> list[_Item]:
        """Every item by decreasing LPT key, then gid: a leaf phase takes those not yet placed."""
        order = self.orders.get(size)
        if order is None:
            _, keys = self._at(size, self.items)
            order = self.orders[size] = sorted(self.by_gid, key=keys.__getitem__, reverse=True)
        return order

    def plan(self, theta: float, leaf: int, width: dict[int, int] | None = None) -> tuple[list[Blocks], float]:
        """One candidate; ``width``: ``widths(theta, leaf)`` if the caller has it already."""
        width = self.widths(theta, leaf) if width is None else width
        by_width: dict[int, list[_Item]] = {}
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
        node_of: dict[_Item, int] = {}
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
        packs: list[list[list[_Item]]] = [[] for _ in range(nodes)]
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
                _split_to(node, count)
        if last:  # leaves lent sequences to each other: recount
            own = [sum(map(costs.__getitem__, chain.from_iterable(node))) for node in packs]
        return packs, own

    def _filler(self) -> _Item:
        """The cheapest sequence not yet placed (it runs widened at this depth)."""
        while self.pool_pos < len(self.pool):
            it = self.pool[self.pool_pos]
            self.pool_pos += 1
            if it.gid not in self.taken:
                self.taken.add(it.gid)
                return it
        raise _Infeasible("no sequence left to fill a node")

    @staticmethod
    def _borrow(j: int, packs: list[list[list[_Item]]], held: list[int], count: int) -> _Item:
        """The shortest sequence of the leaf (other than ``j``) with the most spare sequences
        (``held``: sequences per leaf, the donor's decremented here)."""
        others = held[:j] + held[j + 1:]
        if not others or max(others) <= count:
            raise _Infeasible("leaves have too few sequences for equal micro-batch counts")
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
                    _split_to(p, len(p) + 1)
                need -= 1
        if need:
            raise _Infeasible("no phase can be split further")


class _Row:
    __slots__ = ("blocks", "free")

    def __init__(self):
        self.blocks: list[list] = []  # [start, size, room, items]
        self.free = 0  # first rank without a block (blocks are created in non-increasing size order)


def _dense(items: list[_Item], n: int, mslpr: int, leaf: int, cost: CostModel,
           spread: bool = False) -> tuple[list[Blocks], float]:
    """Fewest micro-batches: sequences at their ``cp_min``, decreasing (CP size, then length), into
    the first block of their size with room, else a new block at a row's first free ranks, else the
    room left in a wider block, else a new row. ``spread``: start from the least possible number of
    rows (tokens / (n x mslpr)), put a new block in the row with the most free ranks and a sequence
    in the fullest block that holds it (best fit), which packs batches that fill ~99% of the rows.
    Rows are then completed (every rank needs a non-empty block): a ``leaf``-sized block takes a
    sequence from the block with the most (of any row), else the row's last block widens, else the
    row becomes one block of all ``n`` ranks. Returns (rows, simulated step time); blocks may wait
    for stragglers here, and the prediction counts it (``simulate``'s arithmetic)."""
    rows: list[_Row] = [_Row() for _ in range(-(-sum(it.L for it in items) // (n * mslpr)) if spread else 0)]
    open_blocks: dict[int, list] = {}
    open_sizes: list[int] = []  # the keys of ``open_blocks``, increasing

    def fit(blocks, L):
        """The first block with room for L, or (``spread``) the first of those with the least room."""
        if not spread:
            for b in blocks:
                if b[2] >= L:
                    return b
            return None
        best = None
        for b in blocks:
            if b[2] >= L and (best is None or b[2] < best[2]):
                best = b
        return best

    for it in sorted(items, key=lambda x: (-x.cp, -x.L, x.gid)):
        s = it.cp
        blk = fit(open_blocks.get(s, ()), it.L)
        row = None
        if blk is None:  # the first row with s free ranks, or (``spread``) the first with the most
            for r in rows:
                if n - r.free >= s and (row is None or r.free < row.free):
                    row = r
                    if not spread:
                        break
        if blk is None and row is None:  # room left in a wider block beats a new micro-batch
            blk = fit([b for w in open_sizes if w > s for b in open_blocks[w]], it.L)
        if blk is None:
            if row is None:
                row = _Row()
                rows.append(row)
            blk = [row.free, s, s * mslpr, []]
            row.blocks.append(blk)
            row.free += s
            if s not in open_blocks:
                open_blocks[s] = []
                insort(open_sizes, s)
            open_blocks[s].append(blk)
        blk[3].append(it)
        blk[2] -= it.L
    for row in rows:
        while row.free < n:
            donor = None
            if n - row.free >= leaf:  # the first block holding the most (> 1) sequences, one of them leaf-sized
                most = 1
                for r in rows:
                    for b in r.blocks:
                        if len(b[3]) > most and any(x.cp <= leaf for x in b[3]):
                            donor, most = b, len(b[3])
            if donor is not None:
                it = min((x for x in donor[3] if x.cp <= leaf), key=lambda x: (x.L, x.gid))
                donor[3].remove(it)
                donor[2] += it.L
                row.blocks.append([row.free, leaf, leaf * mslpr - it.L, [it]])
                row.free += leaf
                continue
            last = row.blocks[-1]
            prev = row.blocks[-2][1] if len(row.blocks) > 1 else n
            if last[0] % (2 * last[1]) == 0 and last[0] + 2 * last[1] <= n and prev >= 2 * last[1]:
                row.free += last[1]
                last[2] += last[1] * mslpr
                last[1] *= 2
                continue
            everything = [x for b in row.blocks for x in b[3]]
            row.blocks = [[0, n, n * mslpr - sum(x.L for x in everything), everything]]
            row.free = n
    return _rows_out([row.blocks for row in rows], n, cost)


def _rows_out(rows: list[list[list]], n: int, cost: CostModel) -> tuple[list[Blocks], float]:
    """Rows of ``[start, size, room, items]`` blocks -> (``Blocks`` rows, simulated step time)."""
    return _blocks_out(rows), _simulate(rows, n, cost)


def _blocks_out(rows: list[list[list]]) -> list[Blocks]:
    return [[(size, [x.gid for x in its]) for _, size, _, its in blocks] for blocks in rows]


def _simulate(rows: list[list[list]], n: int, cost: CostModel) -> float:
    """Simulated step time of rows of ``[start, size, room, items]`` blocks: a block starts when its
    slowest rank is free (``simulate``'s arithmetic, term for term: a single-rank block's
    ``max`` of one value is that value, and ``_Item.own`` is ``cost(cp)`` computed once)."""
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


def _fullest_subset(sizes: list[int], cap: int) -> list[int]:
    """Indices (decreasing) of a subset of ``sizes`` with the largest sum <= ``cap`` (exact subset
    sum on a bitset: bit t of ``reach[i]`` = some subset of the first i sizes sums to t); among
    equal sums, the one the backward walk finds first (deterministic). The scan stops at the first
    prefix of ``sizes`` that reaches ``cap`` exactly: later sizes cannot fill it more (``_tight`` calls
    this per bin on hundreds of sequences at 32 ranks, and most bins fill exactly after a few).
    A size over ``cap`` leaves the bitset as it is (its shift lands above the mask): no big-int work.

    The backward walk steps down the prefixes and takes size i when its target t is not reachable
    without it (``reach[i]`` lacks t). ``reach[i]`` only gains bits as i grows, so the size it takes
    next is the one just below the least prefix that reaches t: found by galloping down from the
    last pick (picks tend to lie close together; after an exact fill the first is the last size
    scanned) and then bisecting, the same picks in a few big-int tests instead of one per prefix."""
    full = 1 << cap
    mask = (full << 1) - 1
    r = 1
    reach = [r]
    for w in sizes:
        if w <= cap:
            r |= (r << w) & mask  # (r has no bit above cap: the mask need not touch it)
            if r >= full:  # bit cap set (nothing above it survives the mask): filled exactly
                reach.append(r)
                break
        reach.append(r)
    t = r.bit_length() - 1
    picked = []
    hi = len(reach) - 1  # reach[hi] has bit t
    while t:
        step, lo = 1, hi - 1
        while lo > 0 and reach[lo] >> t & 1:  # gallop down while t stays reachable
            hi, lo = lo, lo - step
            step *= 2
        if lo < 0:
            lo = 0
        while hi - lo > 1:  # reach[lo] lacks t (reach[0] is {0} and t > 0), reach[hi] has it
            mid = (lo + hi) // 2
            if reach[mid] >> t & 1:
                hi = mid
            else:
                lo = mid
        picked.append(lo)  # reach[lo + 1] is the least prefix reaching t: size lo is needed
        t -= sizes[lo]
        hi = lo
    return picked


def _tight(items: list[_Item], n: int, mslpr: int, leaf: int, cost: CostModel) -> tuple[list[Blocks], float] | None:
    """Rows packed to the least possible count, ``ceil(tokens / (n x mslpr))``, or one more
    (``_dense``'s greedy often needs one row more when a batch fills ~98% of its rows, and on a
    launch-bound GPU a row costs ~10% of the step). Sequences wider than ``leaf`` are laid out
    first (``_wide_layouts``: blocks of their ``cp_min`` packed into rows, or as few rows as can hold
    them, since rank 0 pays the CP block cost of every row that has one); the free ranks become
    ``leaf`` blocks; then each fill strategy (``FILLS``) places the short sequences: optionally those
    over half a slot first by best fit, then bin after bin (in one of ``BIN_ORDERS``) takes the
    subset of the remaining ones that fills it most (exact subset sum); ``_settle`` places what is
    left by moving one sequence, ``_lend`` gives empty bins one. Layouts are tried by their time
    before filling (a bound on any fill of them) until that cannot beat the best, skipping those
    whose mean busy time (``_mean_busy``, another bound) cannot either; of the fills that place
    every sequence and leave no block empty, the least predicted step time wins (ties: fewer
    rank-blocks of CP, then the first). None when every candidate fails; the caller's other
    candidates then stand."""
    least = -(-sum(it.L for it in items) // (n * mslpr))
    wide = sorted((it for it in items if it.cp > leaf), key=lambda x: (-x.cp, -x.L, x.gid))
    short = sorted((it for it in items if it.cp <= leaf), key=lambda x: (-x.L, x.gid))
    layouts = []
    packed = min_bins([it.L for it in wide], n * mslpr).bins if wide else []  # for both row counts
    for rows_n in (least, least + 1):
        for rows in _wide_layouts(wide, n, mslpr, leaf, rows_n, packed):
            shape = [[(b[0], b[1], [x.gid for x in b[3]]) for b in row] for row in rows]
            if all(shape != other for _, _, other, _ in layouts):
                # the rows' time before short sequences join: filling only lengthens blocks, so no
                # fill of this layout can beat it (``simulate`` is monotone in block durations)
                layouts.append((_simulate(rows, n, cost), len(layouts), shape, rows))
    best, best_key = None, None
    short_work = sum(x.cost(1) for x in short)
    for floor, _, _, rows in sorted(layouts, key=lambda t: t[:2]):
        if best is not None and floor >= best[1]:
            break
        if best is not None and _mean_busy(rows, n, cost, short_work) > best[1] * (1 + 1e-9):
            continue  # no fill of it can beat the best (``_mean_busy``: the margin covers rounding)
        got = _fill(rows, short, n, mslpr, leaf, cost)
        if got is not None and (best_key is None or got[0] < best_key):
            best, best_key = got[1], got[0]
    return best


def _mean_busy(rows: list[list[list]], n: int, cost: CostModel, short_work: float) -> float:
    """A lower bound on the predicted step time of any fill of a layout: every rank ends no earlier
    than the time it is busy, so the step is at least the ranks' mean busy time, the layout's blocks
    (size x duration) plus, per short sequence, at least ``cost(1)`` (``short_work``: on s ranks it adds
    ``s x cost(s) = work + cp_comm x L x (s - 1) >= cost(1)``). Both this and ``_simulate`` add up
    non-negative terms, fewer than ``TIGHT_MAX_WORK`` along any chain, so each is within ~1e-11 of
    its exact value; ``_tight`` skips a layout only when this exceeds the best by a 1e-9 margin."""
    busy = sum(b[1] * (sum(x.cost(b[1]) for x in b[3]) + cost.block_overhead(b[1])) for row in rows for b in row)
    return (busy + short_work) / n


def _fill(rows, short, n, mslpr, leaf, cost):
    """((predicted time, CP rank-blocks), (rows, predicted time)) of the best fill of ``rows`` with
    ``short`` (sorted by decreasing length, then gid) over the fill strategies, or None if none places
    every sequence in a non-empty block.
    A strategy that strands sequences is retried (``FILL_RETRIES`` times) with them placed first."""
    best, best_key = None, None
    all_bins = [b for row in rows for b in row]
    fixed = [(b, list(b[3]), b[2]) for b in all_bins]
    cp_rank_blocks = sum(b[1] for b in all_bins if b[1] > 1)
    half = leaf * mslpr // 2
    # best fit of the early sequences: the bin of least (room, start, size), ties to the first in
    # ``all_bins``, i.e. the least of these keys with room >= L; kept sorted (bisect) as rooms shrink
    # instead of scanning every bin per sequence. Every attempt starts from the same rooms.
    fit_keys = sorted((room, b[0], b[1], j) for j, (b, _, room) in enumerate(fixed))
    for first, k in FILLS:
        early = {x.gid for x in short if x.L > half} if first else set()
        for _ in range(FILL_RETRIES + 1):
            for b, its, room in fixed:
                b[3], b[2] = list(its), room
            left = [x for x in short if x.gid not in early]  # longest first, as ``short``
            keys = list(fit_keys)
            unplaced = False
            for it in (x for x in short if x.gid in early):  # longest first, best fit
                pos = bisect_left(keys, (it.L,))  # the first key with room >= L
                if pos == len(keys):
                    left.append(it)
                    unplaced = True
                    continue
                _, start, size, j = keys.pop(pos)
                b = all_bins[j]
                b[3].append(it)
                b[2] -= it.L
                insort(keys, (b[2], start, size, j))
            if unplaced:  # else ``left`` is in ``short``'s order already: longest first, then gid
                left.sort(key=lambda x: (-x.L, x.gid))
            lens = [x.L for x in left]
            for b in sorted(all_bins, key=BIN_ORDERS[k]):
                if not left:
                    break
                if lens[-1] > b[2]:  # not even the shortest fits (``left`` is longest first)
                    continue
                for i in _fullest_subset(lens, b[2]):  # decreasing: pops keep the others' indices
                    b[3].append(left.pop(i))
                    b[2] -= lens.pop(i)
            stranded = {x.gid for x in left}
            if _settle(left, all_bins) and _lend(all_bins):
                key = (_simulate(rows, n, cost), cp_rank_blocks)
                if best_key is None or key < best_key:  # only a new best needs its rows copied out
                    best, best_key = (_blocks_out(rows), key[0]), key
                break
            if not stranded or stranded <= early:
                break
            early |= stranded
    return None if best is None else (best_key, best)


def _settle(left: list[_Item], bins: list[list]) -> bool:
    """Place the sequences the subset-sum fill left over (longest first): into a bin with room, or
    into one whose item of the least length that frees enough room moves to another bin with room
    for it (best fit). False if one stays unplaced. The fill packs bin after bin almost exactly and
    can strand one mid-length sequence when the slack of a whole batch is ~2%.

    Bins are ranked by index on ties. While one sequence looks for a place no room changes, so the
    bins sorted by (room, index) are built once per sequence and the best fit for the moved one is
    a bisection (the first with room >= its length, stepping past its own bin), not a scan of all
    bins per candidate bin: a sequence that finds no place tries every bin."""
    for x in sorted(left, key=lambda it: (-it.L, it.gid)):
        asc = sorted((b[2], k) for k, b in enumerate(bins))
        rooms = [room for room, _ in asc]
        for _, kb in sorted(asc, key=lambda rk: (-rk[0], rk[1])):  # most room first
            b = bins[kb]
            if b[2] >= x.L:
                break
            need = x.L - b[2]
            y = None  # the shortest (then lowest gid) with L >= need
            for z in b[3]:
                if z.L >= need and (y is None or (z.L, z.gid) < (y.L, y.gid)):
                    y = z
            if y is None:
                continue
            pos = bisect_left(rooms, y.L)  # the least (room, index) with room >= y.L ...
            if pos < len(asc) and asc[pos][1] == kb:  # ... other than b
                pos += 1
            if pos == len(asc):
                continue
            to = bins[asc[pos][1]]
            b[3].remove(y)
            b[2] += y.L
            to[3].append(y)
            to[2] -= y.L
            break
        else:
            return False
        b[3].append(x)
        b[2] -= x.L
    left.clear()
    return True


def _lend(bins: list[list]) -> bool:
    """Give every empty bin the shortest sequence that fits it from the bin holding the most
    sequences (ties: the first); False if some bin stays empty. A row more than the least leaves
    slack, and the fullest-first fill can run out of sequences before the last bins."""
    for b in bins:
        if b[3]:
            continue
        donors = [d for d in bins if len(d[3]) > 1 and any(x.L <= b[2] for x in d[3])]
        if not donors:
            return False
        d = max(donors, key=lambda d: len(d[3]))
        it = min((x for x in d[3] if x.L <= b[2]), key=lambda x: (x.L, x.gid))
        d[3].remove(it)
        d[2] += it.L
        b[3].append(it)
        b[2] -= it.L
    return True


def _wide_layouts(wide: list[_Item], n: int, mslpr: int, leaf: int, rows_n: int, packed: list[list[int]]):
    """Row layouts (``rows_n`` rows of ``[start, size, room, items]`` blocks, every rank covered)
    holding the sequences wider than ``leaf``, for ``_tight`` to fill:

    1. *by size*: blocks of each sequence's ``cp_min`` (first fit decreasing among equal sizes),
       placed by decreasing size into the first row with room;
    2. *by row*: as few rows as can hold the wide tokens (``packed``, the caller's ``binpack.min_bins``
       of ``n x mslpr``: the same for every ``rows_n``), each row's sequences in blocks of their
       ``cp_min`` (a narrower one may share a wider block's room) when those fit side by side, else
       one block of all ``n`` ranks;
    3. *by row, whole*: the same rows, each one block of ``n`` ranks.

    Every rank of a block of size > 1 - rank 0 in particular, since sizes never increase from left
    to right - pays the CP block's fixed cost (``CostModel.cp_block``), so the number of rows holding
    one bounds the step from below; layout 1 can use more such rows than needed (a CP-2 sequence
    never shares a CP-4 block's room), which 2 and 3 avoid. Layouts that do not fit in ``rows_n``
    rows are skipped."""
    blocks: list[list] = []
    for it in wide:
        blk = next((b for b in blocks if b[1] == it.cp and b[2] >= it.L), None)
        if blk is None:
            blk = [0, it.cp, it.cp * mslpr, []]
            blocks.append(blk)
        blk[3].append(it)
        blk[2] -= it.L
    rows: list[list[list]] = [[] for _ in range(rows_n)]
    free = [0] * rows_n
    ok = True
    for blk in blocks:  # non-increasing sizes: the first row with room keeps every start aligned
        r = next((r for r in range(rows_n) if n - free[r] >= blk[1]), None)
        if r is None:
            ok = False
            break
        blk[0] = free[r]
        free[r] += blk[1]
        rows[r].append(blk)
    if ok and _complete(rows, free, n, mslpr, leaf):
        yield rows
    if not wide or len(packed) > rows_n:
        return
    for whole in (False, True):
        rows, free = [[] for _ in range(rows_n)], [0] * rows_n
        for r, idx in enumerate(packed):
            its = [wide[i] for i in idx]
            row = None if whole else _fine_row(its, n, mslpr)
            if row is None:
                row = [[0, n, n * mslpr - sum(it.L for it in its), its]]
            rows[r], free[r] = row, sum(b[1] for b in row)
        if _complete(rows, free, n, mslpr, leaf):
            yield rows


def _fine_row(its: list[_Item], n: int, mslpr: int) -> list[list] | None:
    """Blocks of the sequences' ``cp_min`` for one row (a sequence joins the fullest block, of its
    size or wider, with room for it), ordered by decreasing size from rank 0; None if they need
    more than ``n`` ranks."""
    blocks: list[list] = []
    for it in its:  # callers pass them by decreasing (cp_min, length)
        fits = [b for b in blocks if b[1] >= it.cp and b[2] >= it.L]
        blk = min(fits, key=lambda b: (b[2], b[0]), default=None)
        if blk is None:
            blk = [len(blocks), it.cp, it.cp * mslpr, []]
            blocks.append(blk)
        blk[3].append(it)
        blk[2] -= it.L
    if sum(b[1] for b in blocks) > n:
        return None
    blocks.sort(key=lambda b: (-b[1], b[0]))
    start = 0
    for b in blocks:
        b[0], start = start, start + b[1]
    return blocks


def _complete(rows: list[list[list]], free: list[int], n: int, mslpr: int, leaf: int) -> bool:
    """Give every row's free ranks ``leaf`` blocks; False if a row cannot be covered exactly."""
    for r, row in enumerate(rows):
        while n - free[r] >= leaf:
            row.append([free[r], leaf, leaf * mslpr, []])
            free[r] += leaf
        if free[r] != n:
            return False
    return True


TIGHT_MAX_WORK = 40_000
"""``_tight`` runs when sequences x ranks is at most this (its subset sums cost ~bins x sequences
big-int shifts per layout and fill; whole ``balanced`` plans under a calibrated GPU cost, medians on
the CPU machine over the step benchmark's batches: ~2 ms at 4 ranks / 73 sequences, ~4.5 ms at
8 / 144, ~27 ms at 32 / 592, ~40 ms at 64 / 580 - about half of what they took before the subset
walk bisected and layouts that cannot win were skipped; the machine's load moves them ~20%)."""

BIN_ORDERS = (lambda b: (b[1], -b[2], b[0]),  # single-rank slots first, the blocks' room last
              lambda b: (b[2], b[0]))  # smallest room first


FILL_RETRIES = 2
"""How often ``_fill`` retries a strategy with the sequences it stranded placed first."""

FILLS = ((True, 1), (False, 1), (True, 0))
"""``_tight``'s fill strategies: (place sequences over half a slot first, by best fit?, index into
``BIN_ORDERS`` of the order in which bins then take their fullest subsets). Chosen on the step
benchmark's batches (4 and 8 ranks, three calibrated cost models): these three are within 0.2% of
all six combinations with a third order (CP blocks' room first, never the best alone) at half the
plan time; pre-placing alone removes the stranded mid-length sequence that made 4 of 30 batches
need a ninth row."""


def schedule_balanced(pairs, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
                      vpp_group: int | None = None, cost: CostModel | None = None) -> list[Blocks]:
    """Our scheduler; inputs assumed validated (see ``harness.plan.api.schedule``)."""
    return plan_balanced(pairs, n_ranks, max_seqlen_per_rank, min_cp_size, vpp_group, cost)[0]


def plan_balanced(pairs, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
                  vpp_group: int | None = None, cost: CostModel | None = None) -> tuple[list[Blocks], float]:
    """(micro-batches, predicted step time under ``cost``) of the best candidate."""
    cost = cost or CostModel.megatron()
    items = [_Item(g, L, cp_min(L, max_seqlen_per_rank, min_cp_size), cost) for g, L in pairs]
    builder = _Builder(items, n_ranks, max_seqlen_per_rank, min_cp_size, vpp_group, cost)
    dense = None
    if cost.per_microbatch > 0 or cost.cp_block > 0:  # micro-batches cost: the fewest of them compete too
        cands = [_dense(items, n_ranks, max_seqlen_per_rank, min_cp_size, cost, spread) for spread in (False, True)]
        if len(items) * n_ranks <= TIGHT_MAX_WORK:
            cands.append(_tight(items, n_ranks, max_seqlen_per_rank, min_cp_size, cost))
        for cand in cands:
            if cand is None:
                continue
            rows, time = cand
            if (not vpp_group or len(rows) % vpp_group == 0) and (dense is None or time < dense[1]):
                dense = (rows, time)
    leaf, why = min_cp_size, ""
    while leaf <= n_ranks:
        best, seen = None, set()
        for theta in THETAS:
            try:
                width = builder.widths(theta, leaf)
                key = tuple(width.values())  # every ``width`` lists the items in the same order
                if key in seen:
                    continue
                seen.add(key)
                rows, time = builder.plan(theta, leaf, width)
            except _Infeasible as e:
                why = str(e)
                continue
            if best is None or time < best[1]:
                best = (rows, time)
        if best is not None:
            return best if dense is None or best[1] <= dense[1] else dense
        leaf *= 2
    if dense is not None:
        return dense
    tokens = sum(L for _, L in pairs)
    least = -(-tokens // (n_ranks * max_seqlen_per_rank))
    raise VPPAlignmentError(
        f"cannot make the micro-batch count a multiple of vpp_group={vpp_group}: {len(pairs)} sequences "
        f"({tokens} tokens) allow between ~{least} and {len(pairs)} micro-batches ({why}); schedule "
        f"more sequences per global batch or use a smaller vpp_group"
    )
