"""The embedding a pipeline's first and last stages share: multi-token prediction looks its shifted tokens up in the
model's own table (DeepSeek-V3, Megatron), and with ``pp > 1`` the MTP blocks run on the last stage, the table's
owner on the first.

The first stage owns the table (``Stage.owns``: its gradient in the stage's buffer, its update by the stage's
optimiser, its norm counted once); the last stage looks tokens up in a replica:

- ``gather_grad``, after the step's last backward and before the DP x CP reduction: the replica's gradient is added
  to the first stage's over the rank's pipeline group (the middle stages add zeros) and dropped on the last stage.
  The reduction then sums the whole gradient over the domain, as at ``pp = 1`` where autograd adds both uses.
- ``refresh``, after the optimiser's update: the first stage's table is broadcast over the pipeline group, so the
  replica holds the updated weights for the next step (at the start every rank builds the same model from the seed).

Megatron all-reduces the two copies' gradients over an embedding group and steps both; sending the gradient one way
and the weights back gives the same numbers and leaves the norm, the clipping and the optimiser (replicated or
distributed) one copy of the table. Each function is a seam: ``harness.faults`` re-creates the gradient that never
reaches the first stage, the gradient combined after the reduction and the replica that is never refreshed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shares(model, stage) -> bool:
    """Whether ``model``'s embedding lives on two stages: multi-token prediction under a pipeline."""
    return model.c.mtp_depth > 0 and stage.pp > 1


def before_reduction() -> bool:
    """Whether ``gather_grad`` runs before the DP x CP reduction (it must: the replica's gradient is nobody's to reduce
    on its own, so after the reduction each first-stage rank would add only its own pipeline's unreduced share, and
    under the distributed optimiser to a buffer whose pieces are already summed elsewhere). A seam: ``harness.faults``
    re-creates the order of Megatron-LM issue #844, the embedding's gradient combined after the reduce-scatter."""
    return True


def gather_grad(model, stage, group) -> None:
    """Add the last stage's gradient of the table to the first stage's (in place, before the domain's reduction);
    every stage of the pipeline group calls it (collective)."""
    w = model.embed.weight
    if stage.first and w.grad is None:  # a buffer view in training; a plain call may have none yet
        w.grad = torch.zeros_like(w)
    g = w.grad if (stage.first or stage.last) and w.grad is not None else torch.zeros_like(w)
    dist.all_reduce(g, group=group)
    if not stage.first:
        w.grad = None  # the replica is not stepped: its gradient now lives on the first stage


def refresh(model, stage, group, first_rank: int) -> None:
    """Broadcast the first stage's (updated) table to every stage of the pipeline group (collective); ``first_rank``:
    the first stage's global rank in this pipeline."""
    with torch.no_grad():
        dist.broadcast(model.embed.weight.data, src=first_rank, group=group)
