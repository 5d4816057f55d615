"""``balanced``'s tightest rows: the least possible micro-batch count (or one more) by minimum-slack subset
sums, for cost models that charge per micro-batch and per CP block."""

from __future__ import annotations

from bisect import bisect_left, insort

from harness.plan.balanced.items import Item, blocks_out, rows_time
from harness.plan.binpack import min_bins
from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks


def fullest_subset(sizes: list[int], cap: int) -> list[int]:
    """Indices (decreasing) of a subset of ``sizes`` with the largest sum <= ``cap`` (exact subset
    sum on a bitset: bit t of ``reach[i]`` = some subset of the first i sizes sums to t); among
    equal sums, the one the backward walk finds first (deterministic). The scan stops at the first
    prefix of ``sizes`` that reaches ``cap`` exactly: later sizes cannot fill it more (``tight`` calls
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


def tight(items: list[Item], n: int, mslpr: int, leaf: int, cost: CostModel) -> tuple[list[Blocks], float] | None:
    """Rows packed to the least possible count, ``ceil(tokens / (n x mslpr))``, or one more
    (``dense``'s greedy often needs one row more when a batch fills ~98% of its rows, and on a
    launch-bound GPU a row costs ~10% of the step). Sequences wider than ``leaf`` are laid out
    first (``_wide_layouts``: blocks of their ``cp_min`` packed into rows, or as few rows as can hold
    them, since rank 0 pays the CP block cost of every row that has one); the free ranks become
    ``leaf`` blocks; then each fill strategy (``FILLS``) places the short sequences: optionally those
    over half a slot first by best fit, then bin after bin (in one of ``BIN_ORDERS``) takes the
    subset of the remaining ones that fills it most (exact subset sum); ``settle`` places what is
    left by moving one sequence, ``lend`` gives empty bins one. Layouts are tried by their time
    before filling (a bound on any fill of them) until that cannot beat the best, skipping those
    whose mean busy time (``mean_busy``, another bound) cannot either; of the fills that place
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
                layouts.append((rows_time(rows, n, cost), len(layouts), shape, rows))
    best, best_key = None, None
    short_work = sum(x.cost(1) for x in short)
    for floor, _, _, rows in sorted(layouts, key=lambda t: t[:2]):
        if best is not None and floor >= best[1]:
            break
        if best is not None and mean_busy(rows, n, cost, short_work) > best[1] * (1 + 1e-9):
            continue  # no fill of it can beat the best (``mean_busy``: the margin covers rounding)
        got = fill(rows, short, n, mslpr, leaf, cost)
        if got is not None and (best_key is None or got[0] < best_key):
            best, best_key = got[1], got[0]
    return best


def mean_busy(rows: list[list[list]], n: int, cost: CostModel, short_work: float) -> float:
    """A lower bound on the predicted step time of any fill of a layout: every rank ends no earlier
    than the time it is busy, so the step is at least the ranks' mean busy time, the layout's blocks
    (size x duration) plus, per short sequence, at least ``cost(1)`` (``short_work``: on s ranks it adds
    ``s x cost(s) = work + cp_comm x L x (s - 1) >= cost(1)``). Both this and ``rows_time`` add up
    non-negative terms, fewer than ``TIGHT_MAX_WORK`` along any chain, so each is within ~1e-11 of
    its exact value; ``tight`` skips a layout only when this exceeds the best by a 1e-9 margin."""
    busy = sum(b[1] * (sum(x.cost(b[1]) for x in b[3]) + cost.block_overhead(b[1])) for row in rows for b in row)
    return (busy + short_work) / n


def fill(rows, short, n, mslpr, leaf, cost):
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
                for i in fullest_subset(lens, b[2]):  # decreasing: pops keep the others' indices
                    b[3].append(left.pop(i))
                    b[2] -= lens.pop(i)
            stranded = {x.gid for x in left}
            if settle(left, all_bins) and lend(all_bins):
                key = (rows_time(rows, n, cost), cp_rank_blocks)
                if best_key is None or key < best_key:  # only a new best needs its rows copied out
                    best, best_key = (blocks_out(rows), key[0]), key
                break
            if not stranded or stranded <= early:
                break
            early |= stranded
    return None if best is None else (best_key, best)


def settle(left: list[Item], bins: list[list]) -> bool:
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


def lend(bins: list[list]) -> bool:
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


def _wide_layouts(wide: list[Item], n: int, mslpr: int, leaf: int, rows_n: int, packed: list[list[int]]):
    """Row layouts (``rows_n`` rows of ``[start, size, room, items]`` blocks, every rank covered)
    holding the sequences wider than ``leaf``, for ``tight`` to fill:

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


def _fine_row(its: list[Item], n: int, mslpr: int) -> list[list] | None:
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
"""``tight`` runs when sequences x ranks is at most this (its subset sums cost ~bins x sequences
big-int shifts per layout and fill; whole ``balanced`` plans under a calibrated GPU cost, medians on
the CPU machine over the step benchmark's batches: ~2 ms at 4 ranks / 73 sequences, ~4.5 ms at
8 / 144, ~27 ms at 32 / 592, ~40 ms at 64 / 580 - about half of what they took before the subset
walk bisected and layouts that cannot win were skipped; the machine's load moves them ~20%)."""

BIN_ORDERS = (lambda b: (b[1], -b[2], b[0]),  # single-rank slots first, the blocks' room last
              lambda b: (b[2], b[0]))  # smallest room first


FILL_RETRIES = 2
"""How often ``fill`` retries a strategy with the sequences it stranded placed first."""

FILLS = ((True, 1), (False, 1), (True, 0))
"""``tight``'s fill strategies: (place sequences over half a slot first, by best fit?, index into
``BIN_ORDERS`` of the order in which bins then take their fullest subsets). Chosen on the step
benchmark's batches (4 and 8 ranks, three calibrated cost models): these three are within 0.2% of
all six combinations with a third order (CP blocks' room first, never the best alone) at half the
plan time; pre-placing alone removes the stranded mid-length sequence that made 4 of 30 batches
need a ninth row."""
