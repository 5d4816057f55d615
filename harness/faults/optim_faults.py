"""Re-creations of distributed-optimiser bugs (``harness.parallel.dist_opt``): each rank steps 1/N of the
parameters, so the gradient norm must be summed over the shards and every bucket gathered back after the update.
"""

from __future__ import annotations

import torch.distributed as dist


def make_norm_of_local_shard(original):
    """The gradient norm of this rank's shard alone: clipping reads the optimiser's own (sharded) parameters' gradients
    and never sums the squares over the data-parallel ranks (Megatron-LM issue #580), so every rank clips its shard by
    a different, smaller norm and reports it."""
    def grad_square_norm(opt):
        return opt.local_square_norm()
    return grad_square_norm


def make_norm_max_of_shards(original):
    """The shards' norms combined by their maximum, as for the infinity norm, instead of summing their squares
    (fairscale PR #167 review: OSS's clip_grad_norm took max(all_gather(norms))): too small whenever the gradient
    is spread over the shards."""
    def grad_square_norm(opt):
        sq = opt.local_square_norm()
        if dist.is_initialized() and dist.get_world_size(opt.group) > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.MAX, group=opt.group)
        return sq
    return grad_square_norm


def make_first_bucket_not_gathered(original):
    """The bucket holding the first parameters (the last to be gathered) misses its all-gather: each rank's own piece
    of it is updated, the rest keeps the previous step's values (Megatron-LM issue #950: with --overlap-param-gather
    the buckets were waited for in an order other than the forward's, and a layer computed with the previous step's
    weights)."""
    import torch

    def gather_params(opt):
        last = len(opt.buffers.buckets) - 1
        opt.publish(range(last))
        (a, b), master = opt.pieces[last], opt.masters[last]
        with torch.no_grad():
            for p, off in opt.buffers.members[last]:  # this rank's own elements only
                lo, hi = max(a, off), min(b, off + p.numel())
                if lo < hi:
                    p.detach().view(-1)[lo - off:hi - off].copy_(master[lo - a:hi - a])
    return gather_params
