"""``megatron-pr2000``: Megatron-LM PR #2000's dynamic-CP scheduler, reproduced exactly.

Semantics (spec 2.3-2.6), for a global batch sorted by length (stable, descending):

1. Buckets of ~equal ``L**2/cp_min`` work, one per distinct ``cp_min`` (literal rule, spec bug 8).
2. Per micro-batch, scan bucket *heads* in order and take the first one that either has a group of
   exactly its ``cp_min`` or enough free positions (no capacity check here: spec bug 11). With
   free positions it opens a new group on the lowest ones; otherwise it joins the least-loaded
   same-size group with room (``packed + L/cp <= max_seqlen_per_rank``), or ends the micro-batch.
3. Once a sequence with a smaller ``cp_min`` than the micro-batch's first one is placed, the
   micro-batch ends as soon as ``max(load) - min(load) <= 0.05 * max(load)`` over all positions.
4. Free positions are filled by doubling the leftmost smallest group; then VPP alignment.

The part-1 design shipped in megatron-core 0.16.1 (``BalancedCPScheduler``) differs in exactly two
named ways, each a flag here so that the differential suite can attribute every difference:
``capacity_check=False`` (a sequence joins a same-size group whatever its tokens) and
``trim_overload=True`` (before filling, the most-loaded group drops its last sequence while that
narrows the load spread; dropped sequences go to the *end* of the leftovers, unsorted). Part 1 also
has no ``min_cp_size`` (use 1) and no VPP alignment. ``PART1 = dict(capacity_check=False,
trim_overload=True)``.

Worked example (spec vector A: N = 8, max_seqlen_per_rank = 2048)::

    lengths {0:8192, 1:4096, 2:3000, 3:2048, 4:1024, 5:1024, 6:512, 7:512, 8:256}
    buckets  [0] | [1, 2] | [3, 4, 5, 6, 7, 8]
    mb0      [[0],[0],[0],[0],[1],[1],[2],[2]]     (8192 on cp4, 4096 and 3000 on cp2)
    mb1      [[3],[3],[4],[4],[5],[6],[7],[8]]     (six cp1 groups, then 3 and 4 doubled)
"""

from __future__ import annotations

from collections import deque

from harness.plan.cost import cp_min
from harness.plan.megatron_common import Blocks, Group, align_upstream, fill_free_ranks, make_buckets

BALANCE_DELTA = 0.05  # upstream's ``delta``
PART1 = {"capacity_check": False, "trim_overload": True}  # megatron-core 0.16.1 BalancedCPScheduler


def _pick_head(buckets: list[deque], groups: list[Group], free: int, cp_of):
    """Step 1: the first bucket head that has a same-size group or enough free positions."""
    sizes = {g.size for g in groups}
    for b in buckets:
        if b:
            gid, L = b[0]
            c = cp_of(L)
            if c in sizes or free >= c:
                return b, gid, L, c
    return None


def _balanced(groups: list[Group], free: int) -> bool:
    loads = [g.load for g in groups] + ([0.0] if free else [])
    hi = max(loads)
    return hi - min(loads) <= BALANCE_DELTA * hi


def _trim(groups: list[Group], free: int, leftovers: list, work_of) -> None:
    """Part-1 only: pop the last sequence of the first most-loaded group while that strictly
    reduces the load spread (never when a position is free or the group holds one sequence)."""
    while True:
        loads = [g.load for g in groups]
        hi, lo = max(loads), (0.0 if free else min(loads))
        if hi - lo <= BALANCE_DELTA * hi or lo == 0:
            return
        g = groups[loads.index(hi)]
        if len(g.ids) <= 1:
            return
        w = work_of(g.lens[-1])
        trial = [x - w if h is g else x for h, x in zip(groups, loads)]
        if max(trial) - min(trial) >= hi - lo:
            return
        leftovers.append((g.ids.pop(), g.lens.pop()))
        g.load -= w


def next_microbatch(seqs, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1, *,
                    capacity_check: bool = True, trim_overload: bool = False):
    """Form one micro-batch from ``seqs`` (upstream's current order). Returns (blocks, leftovers)."""

    def cp_of(L: int) -> int:
        return cp_min(L, max_seqlen_per_rank, min_cp_size)

    def work_of(L: int) -> float:
        return (L * L) / cp_of(L)

    buckets = make_buckets(list(seqs), cp_of, work_of)
    groups: list[Group] = []
    free, first_cp, check_balance = n_ranks, None, False
    while buckets:
        cand = _pick_head(buckets, groups, free, cp_of)
        if cand is None:
            break
        bucket, gid, L, c = cand
        first_cp = c if first_cp is None else first_cp
        if free >= c:
            group = Group(size=c)
            groups.append(group)
            free -= c
        else:
            fits = [g for g in groups if g.size == c and (not capacity_check or g.packed + L / c <= max_seqlen_per_rank)]
            if not fits:
                break
            group = min(fits, key=lambda g: g.load)
        group.add(gid, L, work_of(L))
        bucket.popleft()
        while buckets and not buckets[0]:
            buckets.pop(0)
        check_balance = check_balance or c < first_cp
        if check_balance and buckets and _balanced(groups, free):
            break
    leftovers = [x for b in buckets for x in b]
    if trim_overload:
        _trim(groups, free, leftovers, work_of)
    sizes = [g.size for g in groups]
    fill_free_ranks(sizes, n_ranks)
    return [(s, list(g.ids)) for s, g in zip(sizes, groups)], leftovers


def schedule_pr2000(pairs, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
                    vpp_group: int | None = None, **flags) -> list[Blocks]:
    """Upstream's driver: sort once (stable, descending), form micro-batches until none is left,
    then align to ``vpp_group``. Inputs are assumed validated (see ``harness.plan.api``)."""
    remaining = sorted(pairs, key=lambda p: p[1], reverse=True)
    mbs: list[Blocks] = []
    while remaining:
        blocks, remaining = next_microbatch(remaining, n_ranks, max_seqlen_per_rank, min_cp_size, **flags)
        mbs.append(blocks)
    if vpp_group is not None and vpp_group > 1:
        mbs = align_upstream(mbs, vpp_group, n_ranks)
    return mbs
