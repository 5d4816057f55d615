"""Causal CP attention over a THD pack sliced with TransformerEngine's zig-zag rule.

Each rank of a CP block holds ``q``, ``k``, ``v`` for its zig-zag slice of the pack (two chunks per
sequence, see ``harness.plan.thd``). ``cp_attention``:

1. all-gathers K and V (one collective on the stacked pair) inside the block's process group and
   picks, in one index, the key prefix each local query chunk may see, straight from the gathered
   (rank-major) layout; the backward sums the duplicated keys' gradients in fp32 (one pass on CUDA:
   ``harness.runtime.row_sum``, with the index inverted once per micro-batch) and reduce-scatters
   them in fp32, so each rank gets its slice's gradient summed over the block, rounded once;
2. runs chunk attention with a backend of ``harness.runtime.attention``.

Zig-zag slicing gives every rank the same causal work (chunk r is cheap where chunk 2cp-1-r is
expensive), so no rank waits for another inside the block.

``exchange`` (``EXCHANGES``, or ``te:p2p`` / ``te:all_gather`` / ``te:a2a``: TransformerEngine's CP attention,
``harness.parallel.te_cp``) picks how K/V move: ``gather`` (above; the exchange runs before the
attention kernels) or ``ring`` (``harness.parallel.ring``: K/V passed around the block's ring while each
received block's part of the attention runs, as TransformerEngine's ``p2p`` CP and Megatron's
static-CP baseline do; needs a backend of ``harness.runtime.attention.LSE_BACKENDS``) or ``a2a``
(``harness.parallel.ulysses``: two all-to-alls turn the slice into whole sequences for ``1/cp`` of the
heads; heads must split over the block) or ``auto``:
ring for blocks of at least ``RING_MIN_TOKENS_PER_RANK`` tokens per rank on CUDA (8K at cp 2 and 4,
16K for larger blocks: measured), gather otherwise (``choose_exchange``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harness.parallel import te_cp
from harness.parallel.collectives import gather_keys_values
from harness.parallel.options import EXCHANGES  # noqa: F401 - re-exported
from harness.parallel.ring import RingPlan, ring_attention
from harness.parallel.ulysses import HeadPlan, head_parallel_attention
from harness.plan.thd import whole_chunks, zigzag_chunks, zigzag_permutation
from harness.runtime.attention import DeviceChunks, backend_available, chunk_attention, resolve_lse_backend
from harness.runtime.row_sum import RowSources

RING_MIN_TOKENS_PER_RANK = {2: 8192, 4: 8192}
"""``auto`` picks the ring from this many tokens per rank, by block size; ``RING_MIN_TOKENS_DEFAULT``
for sizes not listed (8 and more: not measured). From ``bench attention`` on H200s (flash, bf16,
16 x 128 heads): at cp 2 and 4 the ring wins every configuration from 8K tokens per rank and loses at
2K (the step benchmark's blocks), where a ring shift outlasts each part. The figures, with their dates
and commits: ``reports/recorded/README.md``, "bench attention" and "Ring probes"."""

RING_MIN_TOKENS_DEFAULT = 16384


def choose_exchange(exchange: str, tokens_per_rank: int, device, cp_size: int = 0) -> str:
    """The exchange a block runs: ``gather`` / ``ring`` as asked; ``auto`` = ring on CUDA (with the
    flash kernels) from ``RING_MIN_TOKENS_PER_RANK`` tokens per rank for a block of ``cp_size``, else
    gather."""
    if te_cp.comm_type(exchange):
        return exchange
    if exchange not in EXCHANGES:
        raise ValueError(f"unknown CP exchange {exchange!r}; choose one of {', '.join(EXCHANGES)} or te:<"
                         f"{'|'.join(te_cp.COMM_TYPES)}> (TransformerEngine's CP)")
    if exchange != "auto":
        return exchange
    dev = torch.device(device)
    least = RING_MIN_TOKENS_PER_RANK.get(cp_size, RING_MIN_TOKENS_DEFAULT)
    return "ring" if dev.type == "cuda" and tokens_per_rank >= least and backend_available("flash", dev) else "gather"


@dataclass(frozen=True)
class CPAttentionPlan:
    """Per micro-batch, per rank: everything the attention of every layer reuses."""

    cp_size: int
    cp_rank: int
    cu_seqlens_padded: tuple[int, ...]
    chunks: DeviceChunks | None  # key_index points into the *gathered* (rank-major) K/V; None with ring
    exchange: str = "gather"  # as run: gather or ring (``auto`` resolved at build)
    ring: RingPlan | None = None
    heads: HeadPlan | None = None  # a2a: the all-to-all's reorder and the whole-sequence attention plan
    key_sources: RowSources | None = None  # gather: ``chunks.key_index`` inverted, for the K/V gradients' sum

    @classmethod
    def build(cls, cu_seqlens_padded, cp_size: int, cp_rank: int, device, exchange: str = "gather") -> CPAttentionPlan:
        exchange = choose_exchange(exchange, int(cu_seqlens_padded[-1]) // max(int(cp_size), 1), device, cp_size)
        if te_cp.comm_type(exchange):  # TransformerEngine slices nothing more and runs the exchange itself
            return cls(cp_size, cp_rank, tuple(int(x) for x in cu_seqlens_padded), None, exchange)
        if cp_size == 1:  # nothing to exchange: both exchanges run the plain THD attention
            return cls(1, 0, tuple(int(x) for x in cu_seqlens_padded),
                       DeviceChunks.build(whole_chunks(cu_seqlens_padded), device), exchange)
        if exchange == "ring":
            return cls(cp_size, cp_rank, tuple(int(x) for x in cu_seqlens_padded), None, "ring",
                       RingPlan.build(cu_seqlens_padded, cp_size, cp_rank, device))
        if exchange == "a2a":
            return cls(cp_size, cp_rank, tuple(int(x) for x in cu_seqlens_padded), None, "a2a",
                       heads=HeadPlan.build(cu_seqlens_padded, cp_size, cp_rank, device))
        plan = zigzag_chunks(cu_seqlens_padded, cp_size, cp_rank)
        row_of = np.empty(int(cu_seqlens_padded[-1]), dtype=np.int64)  # pack position -> gathered row
        row_of[zigzag_permutation(cu_seqlens_padded, cp_size)] = np.arange(row_of.size)
        key_index = row_of[plan.key_index()]
        chunks = DeviceChunks.build(plan, device)
        chunks = DeviceChunks(plan, chunks.cu_q, chunks.cu_k, torch.as_tensor(key_index, device=device),
                              chunks.max_q, chunks.max_k)
        return cls(cp_size, cp_rank, tuple(int(x) for x in cu_seqlens_padded), chunks, "gather",
                   key_sources=RowSources.build(key_index, row_of.size, device))


def cp_attention(q_TH, k_TH, v_TH, plan: CPAttentionPlan, group, *, backend: str = "auto", scale=None):
    """This rank's attention output for its zig-zag slice; ``group`` is the CP block's process group
    (ignored when ``plan.cp_size == 1``)."""
    kind = te_cp.comm_type(plan.exchange)
    if kind:
        return te_cp.te_cp_attention(q_TH, k_TH, v_TH, plan.cu_seqlens_padded, plan.cp_size, group, kind, scale=scale)
    if plan.cp_size == 1:
        return chunk_attention(q_TH, k_TH, v_TH, plan.chunks, backend=backend, scale=scale)
    if plan.exchange == "ring":
        return ring_attention(q_TH, k_TH, v_TH, plan.ring, group, backend=resolve_lse_backend(backend, q_TH.device, q_TH.dtype),
                              scale=scale)
    if plan.exchange == "a2a":
        return head_parallel_attention(q_TH, k_TH, v_TH, plan.heads, group, backend=backend, scale=scale)
    k_TK, v_TK = gather_keys_values(k_TH, v_TH, group, plan.chunks.key_index, plan.key_sources)  # [sum k_len, Hkv, D]
    return chunk_attention(q_TH, k_TK, v_TK, plan.chunks, backend=backend, scale=scale, keys_gathered=True)
