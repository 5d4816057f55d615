"""Gradient all-reduce overlapped with the last backward of a step (DDP / Megatron style buckets).

The gradients of a model's parameters accumulate in place into one flat fp32 buffer (``GradBuffer``: each
``p.grad`` a view of it, micro-batch after micro-batch). ``BucketedGradReducer`` sums that buffer
over a process group in *buckets*: contiguous ranges of whole parameters, taken in reverse parameter
order (the order a backward produces them). During the step's last backward (``arm()`` before it),
a post-accumulate-grad hook counts each parameter in; when a bucket is complete it is all-reduced
asynchronously, so the reduction runs while the backward of earlier layers is still computing.
``finish()`` launches what is left (parameters that got no gradient this time) and waits. Under the distributed
optimiser each bucket is reduce-scattered instead (``scatter``): a rank receives the sum of its own piece.

Buckets launch strictly in index order (a complete bucket waits for the ones before it), so every
rank issues the same collectives in the same order whatever order its hooks fire in: the sums are
those of one all-reduce of the buffer, bucket by bucket, and no rank can deadlock its peers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.parallel.collectives import reduce_scatter as _reduce_scatter
from harness.parallel.options import DEFAULT_BUCKET_ELEMENTS


class GradReduceError(ValueError):
    """The parameters' gradients are not views of the flat buffer the reducer sums."""


class GradBuffer:
    """The gradients of ``params`` as views of one flat buffer (``p.grad = flat[a:b].view_as(p)``): backward
    accumulates into it in place, micro-batch after micro-batch; a reduction sums it in place (one collective,
    or ``BucketedGradReducer``'s buckets); ``zero_()`` clears it for the next step. Parameters ``first`` accepts
    come first, so that they form one prefix (the replicated parameters under expert parallelism)."""

    def __init__(self, params, device=None, dtype=torch.float32, first=None):
        params = list(params)
        if first is not None:
            params = [p for p in params if first(p)] + [p for p in params if not first(p)]
        device = device or (params[0].device if params else torch.device("cpu"))
        self.params = params
        offsets, total = self._layout(params, first)
        self.flat = torch.zeros(total, dtype=dtype, device=device)
        self.offsets = offsets
        for p, offset in zip(params, offsets):
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)

    def _layout(self, params, first) -> tuple[list[int], int]:
        """(each parameter's offset in the flat buffer, the buffer's length): one after the other."""
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        return offsets, total

    def zero_(self) -> None:
        self.flat.zero_()


class BucketedGradReducer:
    """Sum ``flat`` (whose slices are the ``params``' ``.grad``) over ``group``, bucket by bucket.

    ``arm()`` before the last backward of a step; ``finish()`` after it (returns once the whole
    buffer is summed on this device's stream). Without ``arm()``, ``finish()`` reduces every bucket
    then (no overlap). ``launched_in_backward`` counts the buckets the last step launched from hooks.

    ``scatter``: reduce-scatter each bucket instead (the distributed optimiser, ``harness.parallel.dist_opt``): of N
    equal pieces of a bucket, this rank's (its rank in ``group``) receives the bucket's sum in place; the rest of the
    buffer is left with partial sums. Every bucket's length must then be a multiple of N: ``buckets`` gives the
    (padded) buckets of such a layout, in launch order, instead of the ones derived from the parameters here.
    """

    def __init__(self, params, flat: torch.Tensor, group=None, *, bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
                 buckets: list[tuple[int, int]] | None = None, scatter: bool = False):
        if not isinstance(bucket_elements, int) or bucket_elements < 1:
            raise GradReduceError(f"bucket_elements must be an int >= 1, got {bucket_elements!r}")
        params = list(params)
        if flat.dim() != 1 or not flat.is_contiguous():
            raise GradReduceError(f"flat must be one contiguous 1-d buffer, got shape {tuple(flat.shape)}")
        spans = []
        base, size = flat.data_ptr(), flat.element_size()
        for i, p in enumerate(params):
            g = p.grad
            if g is None or g.dtype != flat.dtype or g.device != flat.device or not g.is_contiguous():
                raise GradReduceError(f"parameter {i} ({tuple(p.shape)}): its .grad must be a contiguous "
                                      f"{flat.dtype} view of the flat buffer on {flat.device}; set "
                                      f"p.grad = flat[offset:offset + p.numel()].view_as(p) before backward")
            off, rem = divmod(g.data_ptr() - base, size)
            if rem or off < 0 or off + g.numel() > flat.numel():
                raise GradReduceError(f"parameter {i} ({tuple(p.shape)}): its .grad lies outside the flat buffer; "
                                      f"set p.grad = flat[offset:offset + p.numel()].view_as(p)")
            spans.append((off, off + g.numel(), i))
        spans.sort()
        for (_a0, a1, i), (b0, _, j) in zip(spans, spans[1:]):
            if b0 < a1:
                raise GradReduceError(f"the .grad views of parameters {i} and {j} overlap in the flat buffer")
        self.params, self.flat, self.group, self.scatter = params, flat, group, scatter
        if buckets is not None:
            self.buckets, self.bucket_of = _given_buckets(buckets, spans, flat.numel())
        else:
            self.buckets, self.bucket_of = _buckets(spans, bucket_elements)
        if scatter and self._active():
            n = dist.get_world_size(group)
            odd = [(lo, hi) for lo, hi in self.buckets if (hi - lo) % n]
            if odd:
                raise GradReduceError(f"bucket {odd[0]} cannot be reduce-scattered over {n} ranks: its length is not a "
                                      f"multiple of {n}; lay the buffer out padded (harness.parallel.dist_opt.ShardedBuffers)")
        self._sizes = [0] * len(self.buckets)
        for b in self.bucket_of.values():
            self._sizes[b] += 1
        self._armed = False
        self._pending: list[int] = []
        self._seen: set[int] = set()
        self._next = 0
        self._works: list = []
        self.launched_in_backward = 0
        self.launch_order: list[int] = []  # the last step's buckets, in launch order (always 0, 1, ...)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def _active(self) -> bool:
        return dist.is_initialized() and dist.get_world_size(self.group) > 1

    def _hook(self, i: int):
        def hook(_param) -> None:
            if not self._armed or i in self._seen:
                return
            self._seen.add(i)
            b = self.bucket_of[i]
            self._pending[b] -= 1
            while self._next < len(self.buckets) and self._pending[self._next] == 0:
                self._launch()
                self.launched_in_backward += 1
        return hook

    def _launch(self) -> None:
        lo, hi = self.buckets[self._next]
        self.launch_order.append(self._next)
        self._next += 1
        if not self._active() or hi == lo:
            return
        if self.scatter:  # in place: this rank's piece of the bucket receives the bucket's sum there
            n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
            c = (hi - lo) // n
            self._works.append(_reduce_scatter(self.flat[lo + r * c:lo + (r + 1) * c], self.flat[lo:hi],
                                               group=self.group, async_op=True))
        else:
            self._works.append(dist.all_reduce(self.flat[lo:hi], group=self.group, async_op=True))

    def arm(self) -> None:
        """Reduce buckets as the next backward completes them."""
        self._armed, self._pending, self._seen = True, list(self._sizes), set()
        self._next, self._works, self.launched_in_backward, self.launch_order = 0, [], 0, []

    def finish(self) -> None:
        """Launch the buckets not yet launched (in order) and wait for all of them."""
        if not self._armed:
            self.arm()
        while self._next < len(self.buckets):
            self._launch()
        for w in self._works:
            w.wait()
        self._armed, self._works = False, []

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _buckets(spans, bucket_elements: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """Buckets of whole parameters in reverse offset order: one closes when it holds ``bucket_elements`` or
    the next parameter is not adjacent (a gap)."""
    buckets: list[tuple[int, int]] = []  # [lo, hi) of flat; bucket 0 = the last parameters
    bucket_of: dict[int, int] = {}
    members = 0
    lo = hi = None
    for a, b, i in reversed(spans):
        if members and (hi - lo >= bucket_elements or b != lo):  # full, or a gap: close the bucket
            buckets.append((lo, hi))
            members = 0
        if not members:
            hi = b
        lo = a
        members += 1
        bucket_of[i] = len(buckets)
    if members:
        buckets.append((lo, hi))
    return buckets, bucket_of


def _given_buckets(buckets, spans, n: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """The caller's buckets (in launch order), checked to hold every parameter whole, and each parameter's."""
    buckets = [(int(lo), int(hi)) for lo, hi in buckets]
    for lo, hi in buckets:
        if not 0 <= lo <= hi <= n:
            raise GradReduceError(f"bucket ({lo}, {hi}) is not a range of the flat buffer of {n} elements")
    bucket_of: dict[int, int] = {}
    for a, b, i in spans:
        inside = [k for k, (lo, hi) in enumerate(buckets) if lo <= a and b <= hi]
        if not inside:
            raise GradReduceError(f"parameter {i} (elements {a}..{b} of the flat buffer) lies in no single bucket")
        bucket_of[i] = inside[0]
    return buckets, bucket_of
