"""The CP exchange of ``harness.runtime.ssm``: tokens <-> channel shards inside a CP block's group.

A rank of a block of ``cp`` holds its zig-zag slice of the pack (``[T, C]``, T = P / cp). The SSM
mixer's conv and scan need whole sequences in pack order, so ``CPChannelExchange`` implements the
mixer's ``ChannelExchange``:

- ``to_channels``: one all-to-all; rank j receives channel shard j of every rank's tokens, rank after
  rank (``[cp * T, c]``), and reorders them into pack order (the inverse of
  ``harness.plan.thd.zigzag_permutation``). Backward: the reverse all-to-all.
- ``to_tokens``: the inverse (pack order -> rank-major rows -> reverse all-to-all; channels back in
  shard order). Backward: the forward all-to-all.
- ``replicate``: an all-gather (every rank gets every token, all channels) and the same reorder.
  Backward: a reduce-scatter, so each rank gets its tokens' gradient summed over the ranks that
  read them; in fp32 for 16-bit gradients, cast once (as ``harness.parallel.collectives``).

All three use the block's group, whose size is ``cp``; with ``cp == 1`` they are the identity. On
gloo (torch 2.13) ``all_to_all_single``, ``all_gather_single`` / ``all_gather_into_tensor`` and
``reduce_scatter_single`` / ``reduce_scatter_tensor`` all work (checked by the dist_cpu suite), so
no all-reduce fallback is needed.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from harness.plan.thd import zigzag_permutation

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ExchangeError(ValueError):
    """A ``CPChannelExchange`` built or called with shapes that do not match its block."""


def _tokens_to_channels(u_TC: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``[T, cp * c]`` -> ``[cp * T, c]``: shard j of my tokens goes to rank j; rows rank-major."""
    T, C = u_TC.shape
    send = u_TC.reshape(T, cp, C // cp).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(cp * T, C // cp)


def _channels_to_tokens(y_RC: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``[cp * T, c]`` (rank-major rows) -> ``[T, cp * c]``: rank i's rows go back to rank i, which
    lays the shards it receives side by side in rank order."""
    R, c = y_RC.shape
    send = y_RC.reshape(cp, R // cp, c).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(R // cp, cp * c)


class _ToChannels(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u_TC, group, cp: int):
        ctx.group, ctx.cp = group, cp
        return _tokens_to_channels(u_TC, group, cp)

    @staticmethod
    def backward(ctx, grad_RC):
        return _channels_to_tokens(grad_RC.contiguous(), ctx.group, ctx.cp), None, None


class _ToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RC, group, cp: int):
        ctx.group, ctx.cp = group, cp
        return _channels_to_tokens(y_RC, group, cp)

    @staticmethod
    def backward(ctx, grad_TC):
        return _tokens_to_channels(grad_TC.contiguous(), ctx.group, ctx.cp), None, None


class _Gather(torch.autograd.Function):
    """All-gather ``[T, c]`` -> ``[cp * T, c]`` (rank-major); backward: reduce-scatter of the sum."""

    @staticmethod
    def forward(ctx, v_TC, group, cp: int):
        ctx.group, ctx.cp, ctx.dtype = group, cp, v_TC.dtype
        out = v_TC.new_empty((cp * v_TC.shape[0], *v_TC.shape[1:]))
        _all_gather(out, v_TC.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad_RC):
        acc = grad_RC.to(torch.float32) if grad_RC.element_size() < 4 else grad_RC.contiguous()
        out = acc.new_empty((acc.shape[0] // ctx.cp, *acc.shape[1:]))
        _reduce_scatter(out, acc, group=ctx.group)
        return out.to(ctx.dtype), None, None


def to_channels(u_TC: torch.Tensor, group, cp: int, inverse: torch.Tensor) -> torch.Tensor:
    """Differentiable ``[T, cp * c]`` -> ``[cp * T, c]`` in pack order (``inverse``: pack position ->
    rank-major row): channel shard j of every rank's tokens on rank j (one all-to-all)."""
    return _ToChannels.apply(u_TC, group, cp).index_select(0, inverse)


def to_tokens(y_PC: torch.Tensor, group, cp: int, perm: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_channels`` (``perm``: rank-major row -> pack position)."""
    return _ToTokens.apply(y_PC.index_select(0, perm), group, cp)


def pack_order(cu_seqlens_padded, cp_size: int) -> np.ndarray:
    """The pack position of every rank-major row the exchange gathers (rank after rank, each rank's local
    tokens in its order): the inverse of the zig-zag slicing the data went through (a seam: ``harness.faults``
    re-creates an exchange that assumes another slice layout than the data's)."""
    return zigzag_permutation(cu_seqlens_padded, cp_size)


class CPChannelExchange:
    """``harness.runtime.ssm.ChannelExchange`` for rank ``cp_rank`` of a CP block of ``cp_size``
    whose process group is ``group`` (this rank's group rank must be ``cp_rank``), for one micro-batch
    packed as ``cu_seqlens_padded`` (each sequence a multiple of ``2 * cp_size`` when cp_size > 1)."""

    def __init__(self, group, cp_size: int, cp_rank: int, cu_seqlens_padded, device):
        if cp_size > 1 and (dist.get_world_size(group) != cp_size or dist.get_rank(group) != cp_rank):
            raise ExchangeError(f"cp_size={cp_size}, cp_rank={cp_rank} but the group has "
                                f"{dist.get_world_size(group)} ranks and this is its rank {dist.get_rank(group)}; "
                                "pass the CP block's own group (DynamicGroups.for_block)")
        perm = pack_order(cu_seqlens_padded, cp_size)  # rank-major row -> pack position
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(perm.size)
        self.group, self.shards, self.shard = group, cp_size, cp_rank
        self.total = int(perm.size)
        self._perm = torch.as_tensor(perm, device=device)
        self._inverse = torch.as_tensor(inverse, device=device)  # pack position -> rank-major row

    def _check(self, t: torch.Tensor, rows: int, what: str) -> None:
        if t.dim() != 2 or t.shape[0] != rows:
            raise ExchangeError(f"{what} expects [{rows}, channels], got {list(t.shape)}; the pack has "
                                f"{self.total} tokens over cp={self.shards} ranks")

    def to_channels(self, u_TC: torch.Tensor) -> torch.Tensor:
        self._check(u_TC, self.total // self.shards, "to_channels")
        if u_TC.shape[1] % self.shards:
            raise ExchangeError(f"to_channels got {u_TC.shape[1]} channels, not divisible by cp={self.shards}")
        if self.shards == 1:
            return u_TC
        return to_channels(u_TC, self.group, self.shards, self._inverse)

    def to_tokens(self, y_PC: torch.Tensor) -> torch.Tensor:
        self._check(y_PC, self.total, "to_tokens")
        if self.shards == 1:
            return y_PC
        return to_tokens(y_PC, self.group, self.shards, self._perm)

    def replicate(self, v_TC: torch.Tensor) -> torch.Tensor:
        self._check(v_TC, self.total // self.shards, "replicate")
        if self.shards == 1:
            return v_TC
        return _Gather.apply(v_TC, self.group, self.shards).index_select(0, self._inverse)
