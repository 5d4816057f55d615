"""``megatron-dev``: Megatron-LM PR #5154's packing-aware scheduler (``next_hdp_group_packing_aware``).

Per micro-batch, for the remaining sequences sorted by length (stable, descending):

1. The longest, ``T``, opens a group of ``cp_min(T)`` positions; the load cap is
   ``1.05 * T * max_seqlen_per_rank`` in ``L**2 / s`` units.
2. Every other sequence tries each power of two ``s`` from ``cp_min(L)`` up to N: joining a group of
   size ``s`` with room, or opening one on free positions. Among the options whose projected maximum
   load (over all positions) stays under the cap it takes the smallest projected maximum (ties: the
   first found: smaller ``s``, joins before opening, groups in creation order). Sequences without an
   option wait for a later micro-batch.
3. Free positions are filled by doubling the leftmost smallest group; then VPP alignment (PR #2000's
   ``align_sample_id_groups``, unchanged upstream).

Upstream's ``fallback_full_group`` only runs when no group can be expanded, which cannot happen in a
power-of-two domain (the only kind ``harness.plan.schedule`` accepts), so it has no counterpart here.

Spec vector A (N = 8, max_seqlen_per_rank = 2048)::

    mb0 [[0],[0],[0],[0],[1],[1],[2,4],[2,4]]     mb1 [[3],[3],[3],[3],[5,6,7],[5,6,7],[8],[8]]
"""

from __future__ import annotations

from harness.plan.cost import cp_min
from harness.plan.megatron_common import Blocks, Group, align_upstream, fill_free_ranks

WORKLOAD_CAP_DELTA = 0.05  # upstream's ``_DYNAMIC_CP_WORKLOAD_CAP_DELTA``


def _best_option(L: int, groups: list[Group], free: int, n_ranks: int, mslpr: int, cap: float, c0: int):
    """(projected max, group or None for a new one, size) of the best placement, or None."""
    cur_max = max(g.load for g in groups)
    best = None
    s = c0
    while s <= n_ranks:
        w = L * L / s
        for g in groups:
            if g.size == s and g.packed + L / s <= mslpr:
                pm = max(cur_max, g.load + w)
                if pm <= cap and (best is None or pm < best[0]):
                    best = (pm, g, s)
        if free >= s:
            pm = max(cur_max, w)
            if pm <= cap and (best is None or pm < best[0]):
                best = (pm, None, s)
        s *= 2
    return best


def next_microbatch(seqs, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1):
    """One micro-batch from ``seqs`` (sorted descending). Returns (blocks, leftovers)."""
    (gid0, T), rest = seqs[0], seqs[1:]
    cap = T * max_seqlen_per_rank * (1 + WORKLOAD_CAP_DELTA)
    c0 = cp_min(T, max_seqlen_per_rank, min_cp_size)
    assert c0 <= n_ranks, "validated by the caller"
    groups = [Group(size=c0)]
    groups[0].add(gid0, T, T * T / c0)
    free, leftovers = n_ranks - c0, []
    for gid, L in rest:
        best = _best_option(L, groups, free, n_ranks, max_seqlen_per_rank, cap,
                            cp_min(L, max_seqlen_per_rank, min_cp_size))
        if best is None:
            leftovers.append((gid, L))
            continue
        _, group, s = best
        if group is None:
            group = Group(size=s)
            groups.append(group)
            free -= s
        group.add(gid, L, L * L / s)
    sizes = [g.size for g in groups]
    fill_free_ranks(sizes, n_ranks)
    return [(s, list(g.ids)) for s, g in zip(sizes, groups)], leftovers


def schedule_dev(pairs, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
                 vpp_group: int | None = None) -> list[Blocks]:
    """Upstream's driver around ``next_hdp_group_packing_aware``; inputs assumed validated."""
    remaining = sorted(pairs, key=lambda p: p[1], reverse=True)
    mbs: list[Blocks] = []
    while remaining:
        blocks, remaining = next_microbatch(remaining, n_ranks, max_seqlen_per_rank, min_cp_size)
        mbs.append(blocks)
    if vpp_group is not None and vpp_group > 1:
        mbs = align_upstream(mbs, vpp_group, n_ranks)
    return mbs
