"""Re-creations of expert-parallel dispatch bugs (``harness.dist.expert_parallel``).

Shape legend: ``T`` a rank's local tokens, ``K`` top-k, ``X`` experts.
"""

from __future__ import annotations

import torch


def make_dispatch_other_chunk(original):
    """The dispatch reads the routes of the other zig-zag chunk of the rank's CP slice: under CP a rank
    holds chunks r and 2cp - 1 - r of each sequence, and a dispatcher that indexes the routing map in
    the unsharded order of those chunks (back before front) sends every token of a split sequence to
    the experts chosen for another token. Right for CP 1 blocks, wrong wherever a sequence is split."""
    def dispatch_routes(idx_TK, tokens):
        idx_TK = original(idx_TK, tokens)
        if tokens is None or tokens.cp_size == 1:
            return idx_TK
        parts, offset, cu = [], 0, tokens.cu_seqlens_padded
        for a, b in zip(cu[:-1], cu[1:]):
            half = (b - a) // (2 * tokens.cp_size)
            front, back = idx_TK[offset:offset + half], idx_TK[offset + half:offset + 2 * half]
            parts += [back, front]
            offset += 2 * half
        return torch.cat(parts) if parts else idx_TK
    return dispatch_routes


def make_counts_off_by_one(original):
    """Every rank announces its per-expert counts one expert off (the count of expert e under e + 1, an
    off-by-one in the owners' expert offsets): the owners size their receive buffers for other row
    counts than the senders send (an all-to-all with disagreeing split sizes hangs or corrupts)."""
    def announced_counts(counts_X, shard):
        return torch.roll(original(counts_X, shard), 1)
    return announced_counts
