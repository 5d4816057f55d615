"""Collectives with autograd, on both the torch 2.11 (GPU machine) and 2.13 (CPU) APIs.

``gather_chunk_keys(kv, group, index)`` = ``all_gather(kv)[index]``: every rank's K/V slice,
concatenated in rank order, then the rows each local query chunk may attend. Its backward sums the
gradients of duplicated rows in fp32, reduce-scatters in fp32 and casts once, so each rank receives
its own slice's gradient summed over the CP block. (With bf16 partial sums, one dV element of a 128K
GQA pack on 4 H200s was 6 bf16 ulps off unsharded attention: 1.02x TE's 2.5e-2 tolerance.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather(output, input, group=..., async_op=...)``: the tensor API of either torch (no deprecation warning)."""
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter(output, input, group=..., async_op=...)`` (SUM), as ``all_gather``."""
_all_gather, _reduce_scatter = all_gather, reduce_scatter


class _GatherChunkKeys(torch.autograd.Function):
    """All-gather ``kv`` in ``group`` (None = this rank only), then pick ``index`` rows. Backward:
    the gradients of duplicated rows (a key seen by two query chunks, on several ranks) are summed in
    fp32 and reduce-scattered in fp32, then cast once - as precise as one unsharded kernel's
    accumulation."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, group, index: torch.Tensor) -> torch.Tensor:
        full = kv
        if group is not None and dist.get_world_size(group) > 1:
            full = kv.new_empty((dist.get_world_size(group) * kv.shape[0], *kv.shape[1:]))
            _all_gather(full, kv.contiguous(), group=group)
        ctx.group, ctx.rows, ctx.dtype = group, full.shape[0], kv.dtype
        ctx.save_for_backward(index)
        return full.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        acc = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=torch.float32 if grad.element_size() < 4 else grad.dtype)
        acc.index_add_(0, index, grad.to(acc.dtype))
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            out = acc.new_empty((acc.shape[0] // dist.get_world_size(ctx.group), *acc.shape[1:]))
            _reduce_scatter(out, acc, group=ctx.group)
            acc = out
        return acc.to(ctx.dtype), None, None


def gather_chunk_keys(kv: torch.Tensor, group, index: torch.Tensor) -> torch.Tensor:
    """Differentiable ``all_gather(kv)[index]`` with fp32 gradient accumulation (see above)."""
    return _GatherChunkKeys.apply(kv, group, index)
