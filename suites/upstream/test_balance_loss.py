"""The routers' sequence-level balance loss against the installed megatron-core's own arithmetic
(``switch_load_balancing_loss_func``, which its ``TopKRouter._apply_seq_aux_loss`` calls once per micro-batch).

Per sequence the harness's loss is upstream's times the sequence's tokens (the harness weights each sequence by its
tokens and divides by the batch's with the token losses; upstream averages the micro-batch's sequences). On a THD
pack upstream's router has a batch of one (``reshape(seq_length, -1)``, no ``cu_seqlens``): it balances the pack as one
sequence (Megatron-LM issue #6108), which is the catalogue's ``moe-balance-pack-as-one-sequence``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from harness.runtime.balance import SequenceBalance, seq_aux_loss

pytestmark = pytest.mark.upstream

E, K, COEF, LENGTHS = 8, 2, 1e-2, (5, 17, 9)


def _upstream(logits, idx):
    """megatron-core's loss of one batch of tokens: router probabilities over all experts, counts of the top-k map."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    counts = torch.zeros_like(logits).scatter_(1, idx, 1.0).sum(0)
    return switch_load_balancing_loss_func(probs=logits.softmax(-1), tokens_per_expert=counts,
                                           total_num_tokens=logits.shape[0], topk=K, num_experts=E,
                                           moe_aux_loss_coeff=COEF)


def _pack():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(sum(LENGTHS), E, generator=g, dtype=torch.float64, requires_grad=True)
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(LENGTHS)])
    return logits, logits.detach().topk(K).indices, seq


def _ours(logits, idx, seq, sequences):
    return seq_aux_loss(logits, idx, torch.ones(len(seq), dtype=logits.dtype), SequenceBalance(seq, sequences), COEF, K)


def test_each_sequence_equals_upstreams_loss_times_its_tokens_with_the_same_gradient():
    logits, idx, seq = _pack()
    ours = _ours(logits, idx, seq, len(LENGTHS))
    (g_ours,) = torch.autograd.grad(ours, logits)
    theirs = sum(n * _upstream(logits[seq == s], idx[seq == s]) for s, n in enumerate(LENGTHS))
    (g_theirs,) = torch.autograd.grad(theirs, logits)
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-12 * float(theirs.detach())
    assert torch.allclose(g_ours, g_theirs, rtol=1e-10, atol=1e-16)


def test_upstreams_router_balances_a_thd_pack_as_one_sequence():
    """What ``_apply_seq_aux_loss`` computes for a pack (batch of one): the pooled loss, not the sequences' - the
    harness's result when every token is given one sequence (the fault), and not its result for the pack."""
    from megatron.core.transformer.moe.router import TopKRouter

    src = inspect.getsource(TopKRouter._apply_seq_aux_loss)
    assert "reshape(seq_length, -1)" in src and "cu_seqlens" not in src  # fails the day upstream splits packs
    logits, idx, seq = _pack()
    pooled = float(_upstream(logits, idx).detach()) * len(seq)
    assert abs(float(_ours(logits, idx, torch.zeros_like(seq), 1).detach()) - pooled) <= 1e-12 * pooled
    per_sequence = float(_ours(logits, idx, seq, len(LENGTHS)).detach())
    assert abs(per_sequence - pooled) > 1e-3 * per_sequence
