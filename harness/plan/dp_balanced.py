"""``dp-balanced``: Megatron's static-CP THD packing baseline (``DpBalancedScheduler``, spec 2.10).

Static CP size ``cp = max(min_cp_size, cp_min(longest))`` (pass ``min_cp_size`` to force a larger
static CP, e.g. ``min_cp_size=n_ranks`` for CP over the whole domain); ``dp = n_ranks // cp``.

1. Walk the sequences in the order given (global-id order upstream) and pack greedily: a sequence
   joins the current pack while the pack's tokens stay ``<= cp * max_seqlen_per_rank``.
2. While the pack count is not a multiple of ``dp * vpp_group``, split packs from the back: the last
   sequence of a multi-sequence pack becomes a new single-sequence pack at the end.
3. Micro-batch ``i``, DP replica ``j`` gets pack ``i * dp + j``: every block has size ``cp``.

>>> # packs [0] [1] [2, 3]; 3 is not a multiple of dp = 2, so 3 moves to a pack of its own
>>> schedule_dp_balanced([(0, 900), (1, 700), (2, 600), (3, 100)], n_ranks=2, max_seqlen_per_rank=1024)
[[(1, [0]), (1, [1])], [(1, [2]), (1, [3])]]
"""

from __future__ import annotations

from harness.plan import padding as pad
from harness.plan.cost import cp_min
from harness.plan.errors import BatchTooSmallError, VPPAlignmentError
from harness.plan.megatron_common import Blocks
from harness.plan.padding import SequencePadding


def static_cp_size(pairs, max_seqlen_per_rank: int, min_cp_size: int, padding: SequencePadding | None = None) -> int:
    longest = max((L for _, L in pairs), default=1)
    if padding is not None:
        return padding.cp_min(longest, max_seqlen_per_rank, min_cp_size)
    return cp_min(longest, max_seqlen_per_rank, min_cp_size)


def _split_to_multiple(packs: list[list[tuple[int, int]]], dp: int, vpp: int) -> None:
    multiple, i = dp * vpp, len(packs) - 1
    while len(packs) % multiple:
        if i < 0:
            n = sum(len(p) for p in packs)
            error = VPPAlignmentError if vpp > 1 else BatchTooSmallError
            raise error(
                f"dp-balanced needs a multiple of {multiple} packs (dp={dp} x vpp_group={vpp}) but the "
                f"batch has only {n} sequences in {len(packs)} packs; schedule at least "
                f"{-(-len(packs) // multiple) * multiple} sequences per global batch or use fewer "
                f"DP replicas (a larger min_cp_size) or a smaller vpp_group"
            )
        if len(packs[i]) > 1:
            packs.append([packs[i].pop()])
        else:
            i -= 1


def schedule_dp_balanced(pairs, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
                         vpp_group: int | None = None, padding: SequencePadding | None = None) -> list[Blocks]:
    """``padding``: packs hold each sequence padded for the static CP size (``harness.plan.padding``)."""
    cp = static_cp_size(pairs, max_seqlen_per_rank, min_cp_size, padding)
    dp = n_ranks // cp
    cap = cp * max_seqlen_per_rank
    packs: list[list[tuple[int, int]]] = []
    tokens = 0
    for gid, L in pairs:
        L = pad.planned_tokens(padding, L, cp)  # a module global: the catalogue's seam
        if packs and tokens + L <= cap:
            packs[-1].append((gid, L))
            tokens += L
        else:
            packs.append([(gid, L)])
            tokens = L
    if packs:
        _split_to_multiple(packs, dp, vpp_group or 1)
    return [
        [(cp, [g for g, _ in packs[i * dp + j]]) for j in range(dp)]
        for i in range(len(packs) // dp)
    ]
