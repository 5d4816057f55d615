"""Re-creations of chunked-loss bugs (``harness.runtime.chunked_loss``: the LM head and its cross-entropy over
chunks of tokens) and their catalogue entries. Scenario ``train-bucketed`` runs the chunked head on one TP rank
(its micro-batches padded to a token multiple: padding tokens whose losses carry no weight), ``train-tp-moe`` under
two TP ranks' vocabulary shards.

Each is a fault of the chunked path only: converge's reference computes the logits whole, and the goldens were made
by the whole head.
"""

from __future__ import annotations

from harness.faults.fault import Fault


def make_scalar_upstream_grad(original):
    """Every token's logit gradient multiplied by the first token's upstream gradient, not its own (Liger-Kernel PR
    #1298: the fused linear cross-entropy with ``reduction="none"`` loaded ``grad_output`` as a scalar, so every
    token's gradient was scaled by ``grad_output[0]``; the forward is right, the backward plausible and wrong). Here
    padding tokens and masked positions, whose losses carry weight 0, send gradient into the head and the model."""
    def upstream(grad, start, stop):
        return grad[:1].expand(stop - start)
    return upstream


def make_lse_of_own_columns(original):
    """Each TP rank's log-sum-exp of its own vocabulary columns taken as the whole vocabulary's: the normaliser is
    never combined over TP, so every rank's losses differ and each softmax sums to one over its own shard (the class
    of Megatron-LM issue #7452, item 1: a vocabulary-parallel loss term computed from a rank's own columns without the
    TP reduction - per-rank loss values differ; wrong loss and gradients)."""
    def combine_lse(lse, group):
        return lse
    return combine_lse


CHUNKED_LOSS_FAULTS = (
    Fault(name="chunked-loss-scalar-upstream-grad", title="the chunked head's backward scales every token by the "
                                                          "first token's upstream gradient",
          source="Liger-Kernel PR #1298: LigerFusedLinearCrossEntropy with reduction='none' multiplied every token's "
                 "gradient by grad_output[0] (a scalar load of a per-token gradient): silently wrong grad_weight and "
                 "grad_input whenever tokens carry different weights (masking, padding, per-token scaling)",
          url="https://github.com/linkedin/Liger-Kernel/pull/1298", layer="loss",
          seam="harness.runtime.chunked_loss:upstream", make=make_scalar_upstream_grad,
          check="step1-gradients", expect=r"step-1 gradient of", scenario="train-bucketed"),
    Fault(name="chunked-loss-lse-own-columns", title="the chunked head's log-sum-exp not combined over the TP "
                                                     "ranks' vocabulary shards",
          source="Megatron-LM issue #7452, item 1: vocab_parallel_cross_entropy with label smoothing computed a "
                 "term from each TP rank's own vocabulary columns without the TP reduction, so per-rank losses "
                 "differed (wrong loss and gradients); re-created in the chunked head's normaliser",
          url="https://github.com/NVIDIA/Megatron-LM/issues/7452", layer="loss",
          seam="harness.parallel.vocab_parallel:combine_lse", make=make_lse_of_own_columns,
          check="step1-gradients", expect=r"step-1 gradient of", scenario="train-tp-moe"),
)
"""The chunked loss head's faults, in report order (the catalogue appends them after the vocabulary's)."""
