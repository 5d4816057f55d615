"""Collectives with autograd, on both the torch 2.11 (GPU machine) and 2.13 (CPU) APIs.

``gather_keys_values(k, v, group, index)`` = ``all_gather(k)[index], all_gather(v)[index]`` (one
collective for both): every rank's K/V slice, concatenated in rank order, then the rows each local query
chunk may attend. Its backward sums the gradients of duplicated rows in fp32, reduce-scatters in fp32 and
casts once, so each rank receives its own slice's gradient summed over the CP block. (With bf16 partial
sums, one dV element of a 128K GQA pack on 4 H200s was 6 bf16 ulps off unsharded attention: 1.02x TE's
2.5e-2 tolerance.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.runtime import row_sum
from harness.runtime.row_sum import RowSources

all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather(output, input, group=..., async_op=...)``: the tensor API of either torch (no deprecation warning)."""
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter(output, input, group=..., async_op=...)`` (SUM), as ``all_gather``."""
_all_gather, _reduce_scatter = all_gather, reduce_scatter


class _GatherKeysValues(torch.autograd.Function):
    """All-gather ``k`` and ``v`` (one collective on the stacked pair) in ``group`` (None = this rank only),
    then pick ``index`` rows of each. Backward: the gradients of duplicated rows (a key seen by two query chunks,
    on several ranks) are summed in fp32 (``harness.runtime.row_sum``: one pass on CUDA given ``sources``) and
    reduce-scattered in fp32, then cast once - as precise as one unsharded kernel's accumulation."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, group, index: torch.Tensor, sources):
        full = torch.stack([k, v], dim=1)
        if group is not None and dist.get_world_size(group) > 1:
            local = full
            full = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
            _all_gather(full, local, group=group)
        ctx.group, ctx.shape, ctx.dtype, ctx.sources = group, full.shape, full.dtype, sources
        ctx.save_for_backward(index)
        return full[:, 0].index_select(0, index), full[:, 1].index_select(0, index)

    @staticmethod
    def backward(ctx, grad_k: torch.Tensor | None, grad_v: torch.Tensor | None):
        (index,) = ctx.saved_tensors
        acc = torch.empty(ctx.shape, dtype=torch.float32 if ctx.dtype.itemsize < 4 else ctx.dtype,
                          device=index.device)
        grads = [torch.zeros(index.shape[0], *ctx.shape[2:], dtype=ctx.dtype, device=index.device) if g is None
                 else g.contiguous() for g in (grad_k, grad_v)]
        row_sum.sum_rows(grads, index, ctx.sources, acc)  # a seam: looked up at each call
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            out = acc.new_empty((acc.shape[0] // dist.get_world_size(ctx.group), *acc.shape[1:]))
            _reduce_scatter(out, acc, group=ctx.group)
            acc = out
        acc = acc.to(ctx.dtype)
        return acc[:, 0], acc[:, 1], None, None, None


def gather_keys_values(k: torch.Tensor, v: torch.Tensor, group, index: torch.Tensor,
                       sources: RowSources | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(all_gather(k)[index], all_gather(v)[index])`` with fp32 gradient accumulation (see
    above). ``sources``: ``RowSources.build(index, gathered rows)``, which lets CUDA sum the gradients in one
    pass; without it the backward is ATen's ``index_add_`` (the same numbers)."""
    return _GatherKeysValues.apply(k, v, group, index, sources)
