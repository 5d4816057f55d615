"""The synchronous model's lower bound from its tallest micro-batch.

With a barrier after every micro-batch the step is the sum of the micro-batches' heights (each the load of
its slowest rank). Let ``H`` be the tallest one's height, less ``per_microbatch``. Then:

* every sequence runs on a block whose per-rank cost is at most ``H``, so on at least ``s_i(H)`` ranks (the
  least power of two ``>= cp_min`` with ``seq_cost(L_i, s) <= H``); its rank-time is at least
  ``a_i(H) = seq_area(L_i, s_i(H))`` (rank-time never falls with the CP size);
* the other micro-batches together last at least the rank-time of what they hold over ``N`` ranks, so

      step >= H + per_microbatch * mb_min + (sum of a_i(H) over the sequences not in the tallest) / N;

* the tallest micro-batch holds at most what its ``N`` ranks can: grouping its ranks by the size ``s`` of
  their block (``n_s`` ranks, ``sum n_s <= N``), the sequences run at size ``s`` cost at most ``n_s * H`` of
  rank-time and hold at most ``n_s * max_seqlen_per_rank`` tokens. Short sequences cannot fill a tall
  micro-batch (a rank's tokens run out before its time), long ones pay their K/V exchange wider: the
  linear relaxation of "hold as much ``a_i`` as possible" bounds what the others are spared;
* it holds at most ``N * max_seqlen_per_rank`` tokens, so the others hold the rest, at least the cheapest
  rank-time of that many tokens (a fractional knapsack).

The relaxation is bounded through its dual: for prices ``theta_s`` in [0, 1] (the share of a rank's worth
paid per unit of rank-time rather than per token; any choice is valid), the tallest micro-batch spares at
most the fractional knapsack of values ``a_i`` and weights ``min_s theta_s * seq_area(L_i, s) / H +
(1 - theta_s) * L_i / max_seqlen_per_rank`` in ``N`` ranks. ``H`` is unknown, so the bound is the least over
all ``H`` at least the smallest height the costliest sequence allows: over an interval ``[h0, h1]`` the
terms are taken at ``h1`` (``a_i`` and what fits only grow with ``H``) and the height at ``h0``. The intervals
are refined where the bound is least (a best-first search with a fixed budget of evaluations, so the
result is deterministic), and every interval's figure is a valid bound for its heights, so stopping early
only loosens it.

At 1024 ranks x 8192 sequences of lognormal mean 4096 (16384 tokens per rank) under the GPT cost it is
1.061 / 1.083 / 1.070 times the area bound (seeds 0 / 1 / 2; ~0.2 s): the longest sequences cannot run at
their cp_min in a micro-batch short enough for the rest to fit beside it, and the short ones fill a rank's
tokens long before its time. With 2048 tokens per rank and mean 1024 it adds ~1% (1.014 at 64 ranks x 512
sequences, 1.007 at 1024 x 8192 and 1.008 at 4096 x 32768).
"""

from __future__ import annotations

import heapq

import numpy as np

from harness.plan.cost import CostModel, cp_min

GRID, FIRST = 1.1, 40
"""Ratio of consecutive heights of the first intervals: ``GRID``, or wider so that there are at most ``FIRST``."""
FINEST = 1.001
"""Intervals are not split below this ratio of their ends."""
EVALUATIONS = 2000
"""Budget of dual evaluations (each a sort of the distinct lengths; ~0.1 ms at 8,192 of them)."""
SAFETY = 1e-9
"""The result is lowered by this share, so that rounding in the sums never lifts it above a schedule's time."""


class _Batch:
    """The distinct lengths of a batch with their counts, and their cost at every block size."""

    def __init__(self, lengths: list[int], n: int, mslpr: int, cost: CostModel, min_cp: int):
        L, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
        s0 = np.array([cp_min(int(x), mslpr, min_cp) for x in L], dtype=np.float64)
        lo = int(s0.min())
        self.widths = np.array([lo << k for k in range((n // lo).bit_length())], dtype=np.float64)
        W, Lf = self.widths[:, None], L.astype(np.float64)[None, :]
        work = cost.quadratic * Lf * Lf + cost.linear * Lf + cost.constant
        per_rank = work / W + np.where(W > 1, cost.cp_comm * Lf * (W - 1) / W, 0.0) + cost.per_sequence
        self.cost = np.where(W >= s0[None, :], per_rank, np.inf)
        self.area = self.cost * W
        self.counts = counts.astype(np.float64)
        self.tokens = L.astype(np.float64) / mslpr  # in ranks' worth
        self.n = n
        self.lowest = lowest_height(self.cost)
        self.columns = np.arange(len(L))

    def terms(self, h: float):
        """(fits, a, total rank-time A, rest-token rank-time R) at height ``h`` (fits[k, i]: size k fits)."""
        fits = self.cost <= h
        a = self.area[fits.argmax(axis=0), self.columns]
        total = float((a * self.counts).sum())
        rest = float((self.tokens * self.counts).sum()) - self.n
        return fits, a, total, _cheapest(a, self.tokens, self.counts, rest) if rest > 0 else 0.0

    def spared(self, h: float, fits, a, theta: np.ndarray) -> float:
        """Dual bound on the rank-time the tallest micro-batch (height ``h``) spares the others."""
        w = theta[:, None] * np.where(fits, self.area, 0.0) / h + (1.0 - theta[:, None]) * self.tokens[None, :]
        kappa = np.where(fits, w, np.inf).min(axis=0)
        return _knapsack(a, kappa, self.counts, self.n)


def lowest_height(cost: np.ndarray) -> float:
    """The least height of a micro-batch that holds the costliest sequence: per sequence the least per-rank
    cost over the sizes it may run at (``cost[size, sequence]``, inf where it may not), the largest of those.
    Not the cost at ``cp_min``: a sequence may run wider, and quadratic attention makes that cheaper per rank.
    """
    return float(cost.min(axis=0).max())


def _fill(values, weights, counts, capacity: float, order) -> float:
    """Sum of ``values`` taken whole in ``order`` while their ``weights`` fit ``capacity``, plus the share of the
    next one that fits (each distinct length ``counts`` times): a fractional knapsack in the order given."""
    used = np.cumsum((weights * counts)[order])
    k = int(np.searchsorted(used, capacity))
    got = float((values * counts)[order][:k].sum())
    if k < len(order):
        got += (capacity - (used[k - 1] if k else 0.0)) * float(values[order[k]] / weights[order[k]])
    return got


def _cheapest(a, tokens, counts, need: float) -> float:
    """Least sum of ``a`` (fractionally) over sequences that hold ``need`` tokens."""
    return _fill(a, tokens, counts, need, np.argsort(a / tokens, kind="stable"))


def _knapsack(values, weights, counts, capacity: float) -> float:
    """Most sum of ``values`` (fractionally) with sum of ``weights`` <= ``capacity``."""
    return _fill(values, weights, counts, capacity, np.argsort(-values / weights, kind="stable"))


def _theta(k: int, p: int) -> np.ndarray:
    """Price vector ``p`` of ``0 .. 3 * k`` for ``k`` sizes, a path from rank-time prices everywhere (0) to
    token prices everywhere (``3 * k``): token prices for the sizes below ``p // 3``, rank-time prices above
    it, the size at the boundary in thirds between (a K/V exchange makes the wider sizes the denser, so the
    boundary is the family worth searching; along the path the bound rises to one peak)."""
    j, m = divmod(p, 3)
    return np.array([0.0] * j + ([1.0 - m / 3] if j < k else []) + [1.0] * max(k - j - 1, 0))


def tallest_bound(lengths: list[int], n_ranks: int, max_seqlen_per_rank: int, cost: CostModel, min_cp_size: int,
                  mb_min: int, ceiling: float) -> float:
    """The least over the tallest micro-batch's height of the bound in the module doc, or ``ceiling`` if that
    is less (the caller's other bound: the search need not look above it)."""
    if not lengths:
        return 0.0
    batch = _Batch(lengths, n_ranks, max_seqlen_per_rank, cost, min_cp_size)
    fixed = cost.per_microbatch * max(mb_min, 1)
    k = len(batch.widths)
    last = 3 * k
    lo = batch.lowest
    if lo <= 0 or lo + fixed >= ceiling:  # no cost per token (only fixed ones), or nothing to search
        return min(lo + fixed, ceiling)
    budget = [EVALUATIONS]

    def value(h0: float, h1: float, p: int | None) -> tuple[float, int]:
        """(bound over heights [h0, h1], its price vector): every vector of the path when ``p`` is None,
        else a climb from ``p`` (a sub-interval's best vector is near its parent's)."""
        fits, a, total, rest = batch.terms(h1)
        seen: dict[int, float] = {}

        def at(q: int) -> float:
            if q not in seen:
                budget[0] -= 1
                seen[q] = max(total - batch.spared(h1, fits, a, _theta(k, q)), rest)
            return seen[q]

        if p is None:
            p = max(range(last + 1), key=lambda q: (at(q), -q))
        while budget[0] > 0:
            up = max((q for q in (p - 1, p + 1) if 0 <= q <= last), key=lambda q: (at(q), -q))
            if at(up) <= at(p):
                break
            p = up
        return h0 + fixed + at(p) / batch.n, p

    heap: list[tuple[float, float, float, int]] = []
    h0, ratio = lo, max(GRID, (ceiling / lo) ** (1 / FIRST))
    while h0 + fixed < ceiling:
        h1 = h0 * ratio
        v, p = value(h0, h1, None)
        heap.append((v, h0, h1, p))
        h0 = h1
    heap.append((ceiling, ceiling, ceiling, -1))
    heapq.heapify(heap)
    while True:
        v, h0, h1, p = heapq.heappop(heap)
        if p < 0 or budget[0] <= 0 or h1 / h0 <= FINEST:
            return float(min(v * (1 - SAFETY), ceiling))
        mid = (h0 * h1) ** 0.5
        for a0, a1 in ((h0, mid), (mid, h1)):
            v2, p2 = value(a0, a1, p)
            heapq.heappush(heap, (max(v, v2), a0, a1, p2))
