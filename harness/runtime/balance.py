"""An MoE router's sequence-level load-balancing loss (Megatron's ``seq_aux_loss``, DeepSeek-V3's sequence-wise
balance loss), per logical sequence of a THD pack, under context and sequence parallelism.

For a sequence s of ``T_s`` real tokens routed top-``k`` over ``E`` experts::

    loss_s = coef * E / k * T_s * sum_e f_se * P_se = coef * E / (k * T_s) * sum_e c_se * p_se

``c_se``: the tokens of s that chose expert e (a count, no gradient), ``f_se = c_se / T_s``; ``p_se``: the sum over s's
tokens of the router's probability of e (softmax over all E), ``P_se = p_se / T_s``. Megatron averages the sequences'
losses per micro-batch; here each is weighted by its tokens and the step divides it by the batch's tokens with the
token losses, so a sequence's share does not depend on the pack, micro-batch or CP block that holds it (a mean per
micro-batch does), and every layout of a batch has the same loss as its one-rank reference.

A pack holds several sequences: every token carries its sequence (``SequenceBalance.seq_T``); taking the pack for one
sequence is Megatron-LM issue #6108. Under CP a sequence's tokens are spread over its block's ranks, under sequence
parallelism over the TP ranks' rows too: the counts ``c_se`` and ``T_s`` must be the whole sequence's, so
``SequenceBalance.reduce`` sums them over those ranks (the micro-batch's CP group, then TP), without gradient. ``p_se``
stays this rank's part: each rank's loss is ``coef * E / (k * T_s) * sum_e c_se * p_se(own tokens)``, the ranks'
losses add up to ``loss_s`` and each rank's probabilities get exactly their gradient. Summing the counts over the
static TP x CP group instead of the micro-batch's block is what Megatron's dynamic CP had to fix (PR #3791).

>>> import torch
>>> logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
>>> b = SequenceBalance(seq_T=torch.tensor([0, 0, 1]), sequences=2)
>>> loss = seq_aux_loss(logits, logits.topk(1).indices, torch.ones(3), b, coef=1.0, top_k=1)
>>> round(float(loss), 4)  # sequence 0: 3 / 2 * (1 * (0.7870 + 0.1065) + 1 * (0.1065 + 0.7870)); 1: 3 * 0.7870
5.0414
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class BalanceError(ValueError):
    """A sequence layout the balance loss cannot use (names the value and the fix)."""


@dataclass(frozen=True)
class SequenceBalance:
    """What the balance loss needs of one micro-batch on this rank (``harness.train.passes`` builds it)."""

    seq_T: torch.Tensor
    """[T] int64: each of this rank's tokens' sequence in the pack, ``0 .. sequences - 1`` (padding: its sequence's;
    the real-token mask leaves it out)."""
    sequences: int
    """The pack's sequences S."""
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Sums an ``[S, E + 1]`` tensor (counts, then tokens) over the other ranks that hold these sequences' tokens, in
    place, and returns it; None: this rank holds all of them."""
    _own: SequenceBalance | None = field(default=None, init=False, repr=False, compare=False)
    """``own_rows``' view, taken once."""

    def __post_init__(self):
        """The ids are checked once, here (one host sync), not in every MoE layer that uses them."""
        if isinstance(self.sequences, bool) or not isinstance(self.sequences, int) or self.sequences < 1:
            raise BalanceError(f"sequences must be an int >= 1 (the pack's sequences), got {self.sequences!r}")
        seq = self.seq_T
        if seq.dim() != 1 or seq.dtype not in (torch.int32, torch.int64):
            raise BalanceError(f"seq_T must be a 1-d integer tensor of sequence ids, got {tuple(seq.shape)} {seq.dtype}")
        if seq.numel():
            lo, hi = torch.aminmax(seq)
            if int(lo) < 0 or int(hi) >= self.sequences:
                raise BalanceError(f"sequence ids must lie in [0, {self.sequences}), got [{int(lo)}, {int(hi)}]: "
                                   f"number the pack's sequences from 0")

    def own_rows(self, rows) -> SequenceBalance:
        """This TP rank's rows (sequence parallelism: ``rows`` is the step's ``TensorParallelOps``, the same for every
        layer of a step), taken once and kept for the micro-batch's other layers."""
        if self._own is None:
            object.__setattr__(self, "_own", SequenceBalance(rows.own_rows(self.seq_T), self.sequences, self.reduce))
        return self._own


def seq_aux_loss(logits_TX: torch.Tensor, idx_TK: torch.Tensor, real_T: torch.Tensor, balance: SequenceBalance,
                 coef: float, top_k: int) -> torch.Tensor:
    """This rank's part of the sum over the pack's sequences of ``loss_s`` (module doc): ``logits_TX`` the router's
    logits of this rank's tokens, ``idx_TK`` their chosen experts, ``real_T`` 1 for a real token."""
    T, E = logits_TX.shape
    seq = balance.seq_T.to(logits_TX.device)
    if seq.shape != (T,):
        raise BalanceError(f"the balance loss got {tuple(seq.shape)} sequence ids for {T} tokens: pass one per token "
                           f"(SequenceBalance.seq_T, this rank's rows)")
    real = real_T.to(logits_TX.dtype)
    probs_TX = logits_TX.softmax(-1) * real[:, None]
    with torch.no_grad():
        stats = logits_TX.new_zeros(balance.sequences, E + 1)
        chosen = torch.zeros_like(logits_TX).scatter_(1, idx_TK, 1.0) * real[:, None]
        stats.index_add_(0, seq, torch.cat([chosen, real[:, None]], dim=1))
        if balance.reduce is not None:
            stats = balance.reduce(stats)
        counts, tokens = stats[:, :E], stats[:, E]
        scale = torch.where(tokens > 0, coef * E / (top_k * tokens.clamp_min(1)), torch.zeros_like(tokens))
    p_SX = logits_TX.new_zeros(balance.sequences, E).index_add(0, seq, probs_TX)
    return (p_SX * counts * scale[:, None]).sum()
