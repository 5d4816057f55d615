"""The distributed optimiser (ZeRO-1; Megatron's ``--use-distributed-optimizer``): each of a stage's N DP x CP ranks
keeps AdamW's state for, and updates, 1/N of the parameters.

Layout (``ShardedBuffers``): the replicated parameters' gradients lie in one flat fp32 buffer (a ``GradBuffer``) in
buckets of whole parameters in reverse order (the order a backward completes them), each padded at its end to a
multiple of N. Rank r owns the r-th of N equal pieces of every bucket, and keeps an fp32 master copy of the
parameters' elements there. The parameters stay the model's own tensors (nothing aliases them). Expert-parallel
parameters (whole on their owner) follow the sharded region and are stepped by their owner as they are.

A step (``DistributedOptimizer``): each bucket of the gradient buffer is reduce-scattered over the group (in the last
backward by the reducer in ``scatter`` mode, or after it: ``reduce_scatter``), so a rank's pieces hold the summed
gradients; the norm is the pieces' squares summed over the group (and the pipeline's stages); the pieces are clipped
and AdamW steps the master pieces; each bucket's updated pieces are all-gathered into the gradient buffer (spent by
then) and copied into the parameters, so every rank holds every updated parameter again. AdamW is elementwise and the
pieces are disjoint: each element is updated as the replicated optimiser updates it from the same summed gradient and
clipping coefficient - what the suites check, bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.parallel.collectives import all_gather, reduce_scatter
from harness.parallel.grad_reduce import DEFAULT_BUCKET_ELEMENTS, GradBuffer
from harness.parallel.options import OPTIMIZERS  # noqa: F401 - re-exported
from harness.parallel.tensor_parallel import is_sharded


class DistributedOptimizerError(ValueError):
    """A distributed optimiser built on buffers or a group that do not match."""


def bucket_layout(sizes: list[int], bucket_elements: int, align: int) -> tuple[list[int], list[tuple[int, int]], int]:
    """(each item's offset, the buckets ``[lo, hi)`` in launch order, the total length) of items of ``sizes`` laid
    out one after the other in buckets: whole items taken in reverse order, a bucket closed once it holds
    ``bucket_elements``, each bucket padded at its end to a multiple of ``align``. Bucket 0 holds the last items."""
    if not isinstance(align, int) or align < 1:
        raise DistributedOptimizerError(f"align must be an int >= 1, got {align!r}")
    if not isinstance(bucket_elements, int) or bucket_elements < 1:
        raise DistributedOptimizerError(f"bucket_elements must be an int >= 1, got {bucket_elements!r}")
    groups: list[list[int]] = [[]]
    held = 0
    for i in reversed(range(len(sizes))):
        if groups[-1] and held >= bucket_elements:  # full: the next item opens a bucket
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += sizes[i]
    if not groups[-1]:  # no items at all
        groups.pop()
    offsets, buckets = [0] * len(sizes), [(0, 0)] * len(groups)
    pos = 0
    for b in reversed(range(len(groups))):  # memory order: the first parameters first
        lo = pos
        for i in reversed(groups[b]):
            offsets[i] = pos
            pos += sizes[i]
        pos = lo + -(-(pos - lo) // align) * align
        buckets[b] = (lo, pos)
    return offsets, buckets, pos


class ShardedBuffers(GradBuffer):
    """A ``GradBuffer`` for the distributed optimiser of ``shards`` ranks: the gradients of the parameters ``first``
    accepts (default all: the replicated ones) in padded buckets (``bucket_layout``), the others after them."""

    def __init__(self, params, shards: int, device=None, dtype=torch.float32, first=None,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS):
        self.shards, self.bucket_elements = shards, bucket_elements
        super().__init__(params, device, dtype, first)
        self.members: list[list[tuple[torch.Tensor, int]]] = [[] for _ in self.buckets]
        for p, off in zip(self.params[:self.count], self.offsets):
            k = next(k for k, (lo, hi) in enumerate(self.buckets) if lo <= off and off + p.numel() <= hi)
            self.members[k].append((p, off))

    def _layout(self, params, first) -> tuple[list[int], int]:
        self.count = sum(1 for p in params if first(p)) if first is not None else len(params)
        offsets, self.buckets, self.end = bucket_layout([p.numel() for p in params[:self.count]],
                                                        self.bucket_elements, self.shards)
        total = self.end
        for p in params[self.count:]:
            offsets.append(total)
            total += p.numel()
        return offsets, total

    def pieces(self, rank: int) -> list[tuple[int, int]]:
        """``[a, b)`` of each bucket's piece that ``rank`` owns (launch order)."""
        return [(lo + rank * ((hi - lo) // self.shards), lo + (rank + 1) * ((hi - lo) // self.shards))
                for lo, hi in self.buckets]


# ---------------------------------------------------------------------------------------- seams
def grad_square_norm(opt: DistributedOptimizer) -> torch.Tensor:
    """The squared norm of the stage's summed gradients: the squares of this rank's pieces and local (expert)
    gradients, summed over the group (a 0-d fp64 tensor on the device; a seam: ``harness.faults`` re-creates the
    norm of one rank's shard alone)."""
    sq = opt.local_square_norm()
    if _size(opt.group) > 1:
        dist.all_reduce(sq, group=opt.group)
    return sq


def tp_square_norm(split: torch.Tensor, rep: torch.Tensor, tp) -> torch.Tensor:
    """This rank's squared-norm share under tensor parallelism from ``split`` (its pieces' squares of split
    parameters) and ``rep`` (of replicated ones): the split squares summed over the TP group, the replicated ones
    counted once (a seam: ``harness.faults`` re-creates a norm that sums the replicated squares over TP too)."""
    dist.all_reduce(split, group=tp.group)
    return split + rep


def gather_params(opt: DistributedOptimizer) -> None:
    """Every bucket's parameters gathered from their owners' updated master pieces (a seam: ``harness.faults``
    re-creates a bucket whose gather is missed, as with an overlapped gather waited for out of order)."""
    opt.publish(range(len(opt.buffers.buckets)))


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class DistributedOptimizer:
    """AdamW (``make_inner``'s) over this rank's pieces of ``buffers`` and over ``local`` parameters (whole on this
    rank: the experts it owns), for a ``group`` of ``buffers.shards`` ranks (see the module doc)."""

    def __init__(self, buffers: ShardedBuffers, group, make_inner, local=(), tp=None):
        """``tp``: the run's tensor parallelism (``harness.parallel.tensor_parallel.TensorParallel``; None at tp = 1):
        the pieces of split parameters then count their squares over the TP group too (``local_square_norm``)."""
        n = _size(group)
        self.tp = tp if tp is not None and tp.size > 1 else None
        if not isinstance(buffers, ShardedBuffers):
            raise DistributedOptimizerError(f"the distributed optimiser needs ShardedBuffers, got "
                                            f"{type(buffers).__name__}")
        if buffers.shards != n:
            raise DistributedOptimizerError(f"the buffers are sharded {buffers.shards} ways but the group has {n} ranks: "
                                            f"build ShardedBuffers(params, shards={n})")
        self.buffers, self.group = buffers, group
        self.rank = dist.get_rank(group) if n > 1 else 0  # its rank in the stage's DP x CP group, not the world's
        self.pieces = buffers.pieces(self.rank)
        self.masters: list[torch.Tensor | None] = []  # per bucket: this rank's fp32 master piece (None: empty)
        for k, (a, b) in enumerate(self.pieces):
            if b <= a:
                self.masters.append(None)
                continue
            m = torch.zeros(b - a, dtype=torch.float32, device=buffers.flat.device)
            for p, off in buffers.members[k]:  # the elements of each parameter that fall in the piece
                lo, hi = max(a, off), min(b, off + p.numel())
                if lo < hi:
                    m[lo - a:hi - a].copy_(p.detach().reshape(-1)[lo - off:hi - off])
            m.grad = buffers.flat[a:b]
            self.masters.append(m)
        self.shard = [m for m in self.masters if m is not None]
        self.local = list(local)
        self.inner = make_inner(self.shard + self.local)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def _grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.shard] + [p.grad for p in self.local if p.grad is not None]

    def reduce_scatter(self) -> None:
        """Sum every bucket of the gradient buffer over the group into its owners' pieces (no overlap)."""
        if _size(self.group) == 1:
            return
        flat, works = self.buffers.flat, []
        for (lo, hi), (a, b) in zip(self.buffers.buckets, self.pieces):
            if hi > lo:
                works.append(reduce_scatter(flat[a:b], flat[lo:hi], group=self.group, async_op=True))
        for w in works:
            w.wait()

    def local_square_norm(self) -> torch.Tensor:
        """The squares of this rank's summed gradient pieces and local gradients (fp64, not yet summed over the group).
        Under tensor parallelism the squares of the elements of split parameters are summed over the TP group here
        (collective), the replicated ones' counted once: summed over the group after, the whole model's."""
        if self.tp is not None:
            return self._tp_square_norm()
        grads = self._grads()
        dev = self.buffers.flat.device
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=dev)
        return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).square().sum()

    def _tp_square_norm(self) -> torch.Tensor:
        split, rep = (torch.zeros((), dtype=torch.float64, device=self.buffers.flat.device) for _ in range(2))
        for k, (a, b) in enumerate(self.pieces):
            if self.masters[k] is None:
                continue
            g = self.masters[k].grad
            for p, off in self.buffers.members[k]:  # the elements of each parameter that fall in the piece
                lo, hi = max(a, off), min(b, off + p.numel())
                if lo < hi:
                    sq = g[lo - a:hi - a].double().square().sum()
                    if is_sharded(p):
                        split += sq
                    else:
                        rep += sq
        for p in self.local:
            if p.grad is not None:
                sq = p.grad.double().square().sum()
                if is_sharded(p):
                    split += sq
                else:
                    rep += sq
        return tp_square_norm(split, rep, self.tp)

    def grad_norm(self, pipeline_group=None) -> torch.Tensor:
        """The whole model's gradient norm (0-d fp64 on the device): the group's, summed over the pipeline's stages."""
        sq = grad_square_norm(self)
        if pipeline_group is not None:
            sq = sq.reshape(1)
            dist.all_reduce(sq, group=pipeline_group)
            sq = sq[0]
        return sq.sqrt()

    def clip_(self, max_norm: float, norm: torch.Tensor) -> None:
        """Scale this rank's gradients by ``min(1, max_norm / (norm + 1e-6))`` (as ``clip_grad_norm_``; no host sync)."""
        coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
        grads = self._grads()
        if grads:
            torch._foreach_mul_(grads, coef)

    def step(self) -> None:
        """AdamW on this rank's master pieces and local parameters, then every bucket's parameters gathered."""
        self.inner.step()
        gather_params(self)

    def publish(self, buckets) -> None:
        """The updated master pieces of ``buckets`` (indices) all-gathered into the gradient buffer (spent after the
        update; ``zero_()`` clears it for the next step) and copied from there into their parameters."""
        flat = self.buffers.flat
        with torch.no_grad():
            for k in buckets:
                a, b = self.pieces[k]
                if self.masters[k] is not None:
                    flat[a:b].copy_(self.masters[k])
            self.gather(flat, buckets)
            for k in buckets:
                if self.buffers.members[k]:
                    members = self.buffers.members[k]
                    torch._foreach_copy_([p.detach() for p, _ in members],
                                         [flat[off:off + p.numel()].view_as(p) for p, off in members])

    def gather(self, buffer: torch.Tensor, buckets) -> None:
        """All-gather the pieces of ``buckets`` (indices) of ``buffer`` (of the gradient buffer's layout) in place."""
        if _size(self.group) == 1:
            return
        works = []
        for k in buckets:
            (lo, hi), (a, b) = self.buffers.buckets[k], self.pieces[k]
            if hi > lo:
                works.append(all_gather(buffer[lo:hi], buffer[a:b], group=self.group, async_op=True))
        for w in works:
            w.wait()

    def gather_grads(self) -> None:
        """The summed gradients of every piece gathered into the whole gradient buffer (for probes: every ``p.grad``
        then holds its summed gradient, as after an all-reduce)."""
        if _size(self.group) > 1:
            self.gather(self.buffers.flat, range(len(self.buffers.buckets)))

    def state_bytes(self) -> int:
        """Bytes of optimiser state this rank keeps."""
        return sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                   if torch.is_tensor(v))

