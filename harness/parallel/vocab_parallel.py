"""The vocabulary split over the TP ranks (Megatron's ``VocabParallelEmbedding``, column-parallel output layer and
``vocab_parallel_cross_entropy``), part of tensor parallelism (``harness.parallel.tensor_parallel``).

TP rank ``r`` of ``tp`` keeps rows ``[r Vp / tp, (r + 1) Vp / tp)`` of the embedding table and of the LM head
(``vocab_range``). ``Vp`` is the vocabulary padded to a multiple of tp (``padded_vocab``; Megatron pads to a multiple
of ``make-vocab-size-divisible-by x tp``, ``TensorParallel.vocab_multiple``): ``shard_model`` appends zero rows to the whole table and head before it
cuts them, no token is ever one of them, and their logits are masked out of the loss (``mask_padding``), so a padded
run trains the unpadded model; ``tensor_parallel.whole`` drops them again.

- **Lookup** (``lookup``): each rank looks up the tokens of its range, zeroes the others' rows, and the partial rows
  are summed over the TP group (``TensorParallel.partial_sums``: all-reduce forward). The mask is part of the graph,
  so a token of another range sends no gradient into this rank's shard.
- **Logits and loss** (``cross_entropy``): the head's input enters as a column-parallel input
  (``TensorParallel.replicated_input``: its gradient all-reduced backward, as each rank's logits see only their
  columns), each rank computes the logits of its range, and the cross-entropy of the whole vocabulary is assembled
  from three all-reduces over the rows - the maximum (stability), the sum of exponentials and the target's logit
  (only its owner's range holds it) - with the exact backward ``softmax - onehot`` on each rank's columns. Every TP rank ends with the same per-token losses.

Both run on whole token rows (with sequence parallelism the block stack gathers its rows before the head and the
embedding's rows are scattered after the lookup, ``harness.parallel.sequence_parallel``). With a loss chunk (``ModelConfig.loss_chunk``) the head and
this loss run over chunks of tokens instead (``chunked_cross_entropy``, ``harness.runtime.chunked_loss``): the same
three all-reduces, of one log-sum-exp a token, and never a whole ``T x V / tp`` block of logits. ``vocab_range``,
``lookup``, ``head_input``, ``mask_padding``, ``cross_entropy`` and ``combine_lse`` are seams (``harness.faults``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.runtime import chunked_loss


def padded_vocab(vocab: int, size: int, multiple: int = 1) -> int:
    """The vocabulary padded to a multiple of ``multiple`` x ``size`` TP ranks (Megatron's
    ``--make-vocab-size-divisible-by`` is ``multiple``)."""
    step = size * multiple
    return -(-vocab // step) * step


def vocab_range(vocab: int, tp) -> tuple[int, int]:
    """[start, end) of the token ids TP rank ``tp.rank`` of ``tp.size`` keeps, of the padded vocabulary: ids from
    ``vocab`` on are padding (a seam)."""
    per = padded_vocab(vocab, tp.size, getattr(tp, "vocab_multiple", 1)) // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def mask_padding(logits: torch.Tensor, start: int, vocab: int) -> torch.Tensor:
    """This rank's logits with its padding columns (ids ``>= vocab``) at -inf: no probability, no gradient (a seam)."""
    pad = start + logits.shape[-1] - vocab
    if pad <= 0:
        return logits
    keep = torch.arange(logits.shape[-1], device=logits.device) < logits.shape[-1] - pad
    return logits.masked_fill(~keep, float("-inf"))


def lookup(tokens: torch.Tensor, table: torch.Tensor, vocab: int, tp) -> torch.Tensor:
    """Every token's embedding row, whole on every TP rank, from this rank's ``table`` shard of the ``vocab`` rows
    (a seam)."""
    start, end = vocab_range(vocab, tp)
    mine = (tokens >= start) & (tokens < end)
    rows = F.embedding((tokens - start).where(mine, 0), table) * mine.unsqueeze(-1).to(table.dtype)
    return tp.partial_sums(rows)


def head_input(h: torch.Tensor, tp) -> torch.Tensor:
    """The LM head's (column-parallel) input: itself forward, its gradient all-reduced over TP backward (a seam)."""
    return tp.replicated_input(h)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy over the whole vocabulary from each rank's logits of its range (fp32)."""

    @staticmethod
    def forward(ctx, logits, labels, start, group):
        peak = logits.detach().max(-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(-1)
        dist.all_reduce(total, group=group)
        mine = (labels >= start) & (labels < start + logits.shape[-1])
        idx = (labels - start).where(mine, 0)
        # where, not a product: a rank whose columns are all padding gathers -inf, and -inf x 0 is NaN
        target = shifted.gather(1, idx.unsqueeze(1)).squeeze(1).where(mine, 0.0)
        dist.all_reduce(target, group=group)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), idx, mine)
        return total.log() - target

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, idx] -= mine.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab: int, tp) -> torch.Tensor:
    """Each token's cross-entropy against ``labels`` (ids in ``[0, vocab)``) from this rank's fp32 ``logits`` of its
    vocabulary range; the same on every TP rank (a seam)."""
    start, _ = vocab_range(vocab, tp)
    return _VocabParallelCE.apply(mask_padding(logits, start, vocab), labels, start, tp.group)


def combine_lse(lse: torch.Tensor, group) -> torch.Tensor:
    """The log-sum-exp over the whole vocabulary from each TP rank's over its columns (``-inf`` where a rank's
    columns are all padding), the same on every rank: the maximum, then the sum of the exponentials relative to it,
    each all-reduced (a seam)."""
    peak = lse.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    total = (lse - peak).exp()
    dist.all_reduce(total, group=group)
    return peak + total.log()


def chunked_cross_entropy(h: torch.Tensor, w, labels: torch.Tensor, vocab: int, tp, chunk: int) -> torch.Tensor:
    """Each token's cross-entropy against ``labels`` from the head shard ``w`` (this rank's rows of the padded
    vocabulary) applied to ``h`` (the head's input, entered through ``head_input``), ``chunk`` tokens at a time
    (``harness.runtime.chunked_loss``); the same on every TP rank."""
    start, _ = vocab_range(vocab, tp)

    def combine(lse, target):  # three all-reduces of one value a token, whatever the chunk count
        dist.all_reduce(target, group=tp.group)  # only the label's owner holds it
        return combine_lse(lse, tp.group), target

    return chunked_loss.head_losses(h, w, labels, chunk, vocab=vocab, start=start, combine=combine)
