"""Head-parallel CP attention (the all-to-all exchange, DeepSpeed-Ulysses' pattern) over a zig-zag slice.

A rank of a CP block of ``P`` holds every head of its zig-zag slice of the pack (``harness.plan.thd``).
One all-to-all turns that into every token of the pack for ``1/P`` of the heads: rank ``j`` receives head
group ``j`` of Q, K and V from every rank (one collective on the three), reorders the rows into pack order
(``harness.parallel.ssm_cp.pack_order``) and runs plain causal THD attention over whole sequences; a second
all-to-all returns each rank its own tokens, every head. The backward is the same two all-to-alls reversed.

Against the all-gather exchange (``harness.parallel.collectives``), per layer and rank:

- bytes: the all-gather receives K and V of ``P - 1`` peers and reduce-scatters their gradients in fp32
  (``2 (P - 1)`` slices of K/V forward, twice that backward, in units of the local K/V slice); the
  all-to-alls send ``(P - 1) / P`` of Q, K, V and the output each way: 3 units forward and backward at MHA
  for P = 4 against 6 and 12;
- precision: each rank computes whole heads, so dK / dV leave one kernel's fp32 accumulation rounded once,
  as unsharded attention's do (no partial sums cross the wire);
- work: every rank runs the same causal work (whole sequences, ``H / P`` heads), whatever the slicing.

Heads must split over the block: ``heads % P == 0``; K/V heads are split as they are when ``kv_heads % P
== 0``, otherwise each K/V head is sent to the ``r = P / gcd(kv_heads, P)`` ranks its query heads live on
(``r`` always divides ``heads / kv_heads``), and the copies' gradients are summed in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from harness.parallel import ssm_cp
from harness.parallel.options import HeadSplitError, kv_replicas  # noqa: F401 - HeadSplitError re-exported
from harness.plan.thd import whole_chunks
from harness.runtime.attention import DeviceChunks, chunk_attention


class _Replicate(torch.autograd.Function):
    """``x.repeat_interleave(r, dim=1)``; backward: the copies' gradients summed in fp32, cast once."""

    @staticmethod
    def forward(ctx, x, r: int):
        ctx.r = r
        return x.repeat_interleave(r, dim=1)

    @staticmethod
    def backward(ctx, g):
        T, H, D = g.shape
        acc = g.reshape(T, H // ctx.r, ctx.r, D).to(torch.promote_types(g.dtype, torch.float32)).sum(2)
        return acc.to(g.dtype), None


def replicate_kv(x: torch.Tensor, r: int) -> torch.Tensor:
    """Each K/V head ``r`` times, copies side by side (head ``h`` -> ``h r .. h r + r - 1``: the copies of a query
    group's head land on the ranks of that group's query heads); a seam (``harness.faults``)."""
    return _Replicate.apply(x, r)


@dataclass(frozen=True)
class HeadPlan:
    """Per micro-batch, per rank: the pack-order reorder and the whole-sequence attention plan."""

    cp_size: int
    cp_rank: int
    chunks: DeviceChunks  # whole sequences of the pack (every rank: the same plan)
    perm: torch.Tensor  # int64: rank-major row -> pack position (pack order -> rank-major rows)
    inverse: torch.Tensor  # int64: pack position -> rank-major row

    @classmethod
    def build(cls, cu_seqlens_padded, cp_size: int, cp_rank: int, device) -> HeadPlan:
        perm = ssm_cp.pack_order(cu_seqlens_padded, cp_size)  # validates the zig-zag divisibility
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(perm.size)
        return cls(int(cp_size), int(cp_rank), DeviceChunks.build(whole_chunks(cu_seqlens_padded), device),
                   torch.as_tensor(perm, device=device), torch.as_tensor(inverse, device=device))


def head_parallel_attention(q_TH, k_TH, v_TH, plan: HeadPlan, group, *, backend: str = "auto", scale=None):
    """This rank's causal attention output ``[T, H, D]`` for its zig-zag slice; ``group``: the block's group."""
    P, (T, H, D), Hkv = plan.cp_size, q_TH.shape, k_TH.shape[1]
    if T * P != plan.perm.numel() or k_TH.shape[0] != T or v_TH.shape[0] != T:
        raise ValueError(f"q/k/v hold {T}/{k_TH.shape[0]}/{v_TH.shape[0]} rows; this rank's zig-zag slice of a "
                         f"{plan.perm.numel()}-token pack over cp={P} has {plan.perm.numel() // P}")
    if group is None or dist.get_world_size(group) != P:
        have = "no group" if group is None else f"a group of {dist.get_world_size(group)} ranks"
        raise ValueError(f"a2a exchange of a CP block of {P} ranks got {have}; pass the block's process group "
                         f"(DynamicGroups.for_block(block_start, {P}))")
    r = kv_replicas(H, Hkv, P)
    if r > 1:
        k_TH, v_TH = replicate_kv(k_TH, r), replicate_kv(v_TH, r)
    hq, hkv = H // P, k_TH.shape[1] // P
    # one all-to-all for the three: channel shard j = head group j of Q, then of K, then of V
    u = torch.cat([t.reshape(T, P, h * D) for t, h in ((q_TH, hq), (k_TH, hkv), (v_TH, hkv))], dim=2)
    x = ssm_cp.to_channels(u.reshape(T, -1), group, P, plan.inverse)  # [P * T, (hq + 2 hkv) D], pack order
    q, k, v = (x[:, a * D:b * D].unflatten(1, (-1, D)) for a, b in ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv)))
    out = chunk_attention(q, k, v, plan.chunks, backend=backend, scale=scale)  # [P * T, hq, D]
    return ssm_cp.to_tokens(out.reshape(P * T, hq * D), group, P, plan.perm).reshape(T, H, D)
