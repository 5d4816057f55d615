"""Collectives with autograd, on both the torch 2.11 (GPU machine) and 2.13 (CPU) APIs.

``all_gather_tokens(x, group)``: concatenate every rank's ``x`` along dim 0 (rank order); its
backward reduce-scatters the gradient, so each rank receives the sum of all ranks' gradients for
its own slice - the gradient of a shared K/V under context parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-gather along dim 0 inside ``group`` (identity for a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllGatherTokens.apply(x, group)
