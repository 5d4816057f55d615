"""Pieces shared by the two Megatron parity schedulers (PR #2000 and PR #5154).

Both schedulers build one micro-batch at a time as a list of CP *groups* in position order; new
groups always take the lowest free positions, so the free positions are always a tail and a group's
place is the prefix sum of the sizes before it. Upstream manipulates per-position lists; this module
works on the groups directly, which makes the buddy layout explicit:

- ``fill_free_ranks``: while positions are free, double the leftmost of the smallest groups (what
  upstream's ``fill_empty_gpus`` and VPP ``fill_empty`` both do for power-of-two domains).
- ``align_upstream``: PR #2000's ``align_sample_id_groups`` (split the last micro-batches at the
  first block boundary at or past N/2; the tail half replaces the micro-batch, the head half is
  appended), with its no-progress cases raised as ``VPPAlignmentError`` instead of looping.
- ``make_buckets``: PR #2000's ``dcp_make_buckets_equal``, either literal (closed buckets counted
  twice, spec bug 8) or with the intended reservation rule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from harness.plan.errors import VPPAlignmentError

BUCKET_OVERFILL = 1.1  # upstream's hard-coded ``target * 1.1``


@dataclass
class Group:
    """One CP group under construction: ``size`` positions packing ``ids`` (per-rank ``packed``
    tokens and ``load`` tracked as upstream does, in floats)."""

    size: int
    ids: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    packed: float = 0.0
    load: float = 0.0

    def add(self, gid: int, L: int, cost: float) -> None:
        self.ids.append(gid)
        self.lens.append(L)
        self.packed += L / self.size
        self.load += cost


def fill_free_ranks(sizes: list[int], n_ranks: int) -> None:
    """Double the leftmost smallest group until the groups cover ``n_ranks`` positions (in place).

    For power-of-two domains the free count is always a multiple of the smallest size, so this
    terminates; upstream's vacuous check (spec bug 2) is replaced by an internal assertion."""
    free = n_ranks - sum(sizes)
    while free > 0:
        assert sizes, "no group to expand"
        m = min(sizes)
        grow = min(2 * m, n_ranks) - m
        assert 0 < grow <= free, f"cannot expand a group of {m} into {free} free positions"
        sizes[sizes.index(m)] = m + grow
        free -= grow


def make_buckets(seqs: list[tuple[int, int]], cp_of, work_of, *, literal: bool = True) -> list[deque]:
    """Split ``seqs`` (sorted by length, descending) into consecutive FIFO buckets of ~equal work,
    one per distinct ``cp_of(L)``. ``literal`` keeps upstream's reservation rule
    ``n - i <= remaining_k - len(buckets)`` (closed buckets counted twice); otherwise the intended
    ``n - i <= remaining_k - 1``."""
    k = len({cp_of(L) for _, L in seqs})
    target = sum(work_of(L) for _, L in seqs) / k
    buckets: list[deque] = []
    cur: list[tuple[int, int]] = []
    cur_work, remaining_k, n = 0.0, k, len(seqs)
    for i, (gid, L) in enumerate(seqs):
        w = work_of(L)
        reserve = remaining_k - len(buckets) if literal else remaining_k - 1
        if cur and (cur_work + w > target * BUCKET_OVERFILL or n - i <= reserve):
            buckets.append(deque(cur))
            cur, cur_work = [], 0.0
            remaining_k -= 1
        cur.append((gid, L))
        cur_work += w
    if cur:
        buckets.append(deque(cur))
    return buckets


Blocks = list[tuple[int, list[int]]]  # one micro-batch: (size, gids) per block, in position order


def _expand(blocks: Blocks, n_ranks: int) -> Blocks:
    sizes = [s for s, _ in blocks]
    fill_free_ranks(sizes, n_ranks)
    return [(s, list(ids)) for s, (_, ids) in zip(sizes, blocks)]


def _split(blocks: Blocks, n_ranks: int) -> tuple[Blocks, Blocks] | None:
    """Split a micro-batch at the first block boundary >= N/2: (tail expanded, head expanded)."""
    if len(blocks) < 2:
        return None
    sizes = [s for s, _ in blocks]
    assert all(a >= b for a, b in zip(sizes, sizes[1:])), f"block sizes increase: {sizes}"
    pos = 0
    for k, s in enumerate(sizes):  # noqa: B007 - k is used after the loop (upstream: no break -> last index)
        if pos >= n_ranks // 2:
            break
        pos += s
    return _expand(blocks[k:], n_ranks), _expand(blocks[:k], n_ranks)


def align_upstream(mbs: list[Blocks], vpp_group: int, n_ranks: int) -> list[Blocks]:
    """PR #2000 ``align_sample_id_groups``: make ``len(mbs)`` a multiple of ``vpp_group`` by
    splitting micro-batches, scanning from the last one backwards (returns a new list)."""
    mbs = [list(mb) for mb in mbs]
    need, i, attempts = (-len(mbs)) % vpp_group, len(mbs) - 1, 0
    while need > 0:
        if i < 0:
            if attempts >= len(mbs):
                raise VPPAlignmentError(
                    f"cannot reach a multiple of vpp_group={vpp_group} micro-batches: {len(mbs)} "
                    f"micro-batches, {need} more needed, and none can be split (each is one CP block "
                    f"of all {n_ranks} ranks); schedule more sequences per global batch or use a "
                    f"smaller vpp_group"
                )
            i = len(mbs) - 1
        halves = _split(mbs[i], n_ranks)
        if halves is None:
            attempts += 1
        else:
            mbs[i] = halves[0]
            mbs.append(halves[1])
            need, attempts = need - 1, 0
        i -= 1
    return mbs
