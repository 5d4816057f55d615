"""Re-creations of vocabulary-parallel bugs (``harness.parallel.vocab_parallel``: the embedding table and the LM head
split by vocabulary rows over the TP ranks) and their catalogue entries, judged in scenario ``train-tp`` (whose
vocabulary is padded: ``make_vocab_size_divisible_by``).

Each is exact at tp = 1, so converge's reference (one rank, no TP) and the goldens see none of them.
"""

from __future__ import annotations

from harness.faults.fault import Fault


def make_embedding_grad_unmasked(original):
    """The other ranges' rows zeroed outside the graph: the forward is right, but the backward sends every foreign
    token's gradient into row 0 of this rank's shard, where its masked index pointed (PyTorch issue #130725: the
    vocab-parallel embedding's mask was not materialised for the backward)."""
    import torch.nn.functional as F

    from harness.parallel import vocab_parallel as vp

    def lookup(tokens, table, vocab, tp):
        start, end = vp.vocab_range(vocab, tp)
        mine = (tokens >= start) & (tokens < end)
        rows = F.embedding((tokens - start).where(mine, 0), table)
        rows = rows + (rows * mine.unsqueeze(-1).to(rows.dtype) - rows).detach()
        return tp.partial_sums(rows)
    return lookup


def make_head_input_grad_not_reduced(original):
    """The vocab-parallel head's input gradient left as each rank's own columns' share: the final norm and every
    block below it get a different gradient on each TP rank (apple/ml-cross-entropy PR #42: the vocab-parallel loss
    returned a rank-local input gradient; TP libraries expect it summed, the same on every TP rank)."""
    def head_input(h, tp):
        return h
    return head_input


def make_ce_on_gathered_logits(original):
    """The logits gathered to the whole vocabulary on every rank and then handed to the vocabulary-parallel loss,
    which takes its range from the width it gets: every rank sums the exponentials of the whole vocabulary, the TP sum
    counts them tp times, and the loss is log(tp) too large with wrong gradients (Megatron-LM issue #7452, item 2:
    GPTModel's labels path with gathered logits, loss = correct + log(TP))."""
    import torch

    from harness.parallel.collectives import all_gather
    from harness.parallel.vocab_parallel import _VocabParallelCE

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, tp):
            ctx.tp = tp
            out = x.new_empty((tp.size * x.shape[0], *x.shape[1:]))
            all_gather(out, x.contiguous(), group=tp.group)
            return torch.cat(out.chunk(tp.size, 0), dim=-1)

        @staticmethod
        def backward(ctx, grad):
            return grad.chunk(ctx.tp.size, -1)[ctx.tp.rank].contiguous(), None

    def cross_entropy(logits, labels, vocab, tp):
        full = Gather.apply(logits, tp)
        return _VocabParallelCE.apply(full, labels, tp.rank * full.shape[-1], tp.group)
    return cross_entropy


def make_range_from_world_rank(original):
    """Each rank's vocabulary range computed from its world rank, not its TP rank: beyond the first position every
    range lies past the vocabulary, so those ranks look up zeros and find no target (TransformerEngine PR #2184: the
    TP rank taken from the world rank when data parallelism is on)."""
    import torch.distributed as dist

    from harness.parallel import vocab_parallel as vp

    def vocab_range(vocab, tp):
        per = vp.padded_vocab(vocab, tp.size, tp.vocab_multiple) // tp.size
        return dist.get_rank() * per, (dist.get_rank() + 1) * per
    return vocab_range


def make_padding_logits_unmasked(original):
    """The padded vocabulary's logits left in the loss: its zero rows' logits (0) take probability from every token,
    the loss rises and the gradients move (unsloth PR #10616: padded lanes of the vocabulary stole probability mass in
    the cross-entropy; Megatron pads the vocabulary to ``make-vocab-size-divisible-by x tp``)."""
    def mask_padding(logits, start, vocab):
        return logits
    return mask_padding


VOCAB_FAULTS: tuple[Fault, ...] = (
    Fault(name="vocab-embedding-grad-unmasked", title="the vocab-parallel embedding's mask left out of the backward",
          source="PyTorch issue #130725: the vocab-parallel embedding's input mask was not materialised for the "
                 "backward, so the masked tokens' gradient reached the shard's row 0",
          url="https://github.com/pytorch/pytorch/issues/130725", layer="gradients",
          seam="harness.parallel.vocab_parallel:lookup", make=make_embedding_grad_unmasked,
          check="step1-gradients", expect=r"step-1 gradient of embed\.weight", scenario="train-tp"),
    Fault(name="vocab-head-input-grad-not-reduced", title="the vocab-parallel head's input gradient not summed over TP",
          source="apple/ml-cross-entropy PR #42: the vocab-parallel loss returned each TP rank's own share of the "
                 "input gradient; a column-parallel head's input gradient must be summed over the TP group",
          url="https://github.com/apple/ml-cross-entropy/pull/42", layer="gradients",
          seam="harness.parallel.vocab_parallel:head_input", make=make_head_input_grad_not_reduced,
          check="replica-consistency", expect=r"parameters differ between ranks: ranks \[1, 3\]", scenario="train-tp"),
    Fault(name="vocab-ce-on-gathered-logits", title="the vocab-parallel loss run on gathered whole-vocabulary logits",
          source="Megatron-LM issue #7452 (item 2): GPTModel's labels path with gathered logits "
                 "(parallel_output=False) gave the loss + log(TP) and wrong gradients",
          url="https://github.com/NVIDIA/Megatron-LM/issues/7452", layer="loss",
          seam="harness.parallel.vocab_parallel:cross_entropy", make=make_ce_on_gathered_logits,
          check="step1-gradients", expect=r"step-1 gradient of", scenario="train-tp"),
    Fault(name="vocab-range-from-world-rank", title="the vocabulary range taken from the world rank",
          source="TransformerEngine PR #2184: the TP rank computed from the world rank under data parallelism; here "
                 "every rank past the first position keeps a range beyond the vocabulary",
          url="https://github.com/NVIDIA/TransformerEngine/pull/2184", layer="model",
          seam="harness.parallel.vocab_parallel:vocab_range", make=make_range_from_world_rank,
          check="step1-gradients", expect=r"step-1 gradient of", scenario="train-tp"),
    Fault(name="vocab-padding-logits-unmasked", title="the padded vocabulary's logits left in the loss",
          source="unsloth PR #10616: the padded lanes of the vocabulary took probability mass in the cross-entropy "
                 "(the valid mass 0.52-0.98 before the fix); Megatron pads to make-vocab-size-divisible-by x tp",
          url="https://github.com/unslothai/unsloth/pull/10616", layer="loss",
          seam="harness.parallel.vocab_parallel:mask_padding", make=make_padding_logits_unmasked,
          check="step1-gradients", expect=r"step-1 gradient of", scenario="train-tp"),
)
"""The vocabulary-parallel faults, in report order (the catalogue appends them after tensor parallelism's)."""
