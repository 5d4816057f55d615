"""The routers' sequence-level load-balancing loss (``harness.runtime.balance``) against a plain per-sequence loop, split
over ranks as CP and sequence parallelism split it, and invariant to how sequences are packed."""

from __future__ import annotations

import argparse

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cli_types import AUX_COEF
from harness.runtime.attention import thd_attention
from harness.runtime.balance import BalanceError, SequenceBalance, seq_aux_loss
from harness.runtime.model import TinyLM
from harness.runtime.model_config import MODELS, ModelConfig
from harness.train.config import TrainConfig
from harness.train.layouts import LayoutError

E, K, COEF = 4, 2, 1e-2


def loop_loss(logits, idx, real, seq, sequences):
    """The definition, sequence by sequence: coef * E / k * T_s * sum_e f_se * P_se over the real tokens of s."""
    total = logits.new_zeros(())
    for s in range(sequences):
        rows = [t for t in range(len(seq)) if int(seq[t]) == s and real[t] > 0]
        if not rows:
            continue
        T = len(rows)
        P = logits[rows].softmax(-1).mean(0)
        f = torch.tensor([sum(e in idx[t].tolist() for t in rows) / T for e in range(E)], dtype=logits.dtype)
        total = total + COEF * E / K * T * (f * P).sum()
    return total


def _batch(lengths, seed=0, pad=2):
    """A pack of ``lengths`` sequences, each followed by ``pad`` padding tokens (real 0)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.cat([torch.full((n + pad,), s) for s, n in enumerate(lengths)])
    real = torch.cat([torch.cat([torch.ones(n), torch.zeros(pad)]) for n in lengths])
    logits = torch.randn(len(seq), E, generator=g, dtype=torch.float64).requires_grad_()
    return logits, logits.detach().topk(K).indices, real.double(), seq


def test_the_loss_and_its_gradient_equal_the_per_sequence_definition():
    logits, idx, real, seq = _batch([5, 1, 9, 3])
    got = seq_aux_loss(logits, idx, real, SequenceBalance(seq, 4), COEF, K)
    (g_got,) = torch.autograd.grad(got, logits)
    want = loop_loss(logits, idx, real, seq, 4)
    (g_want,) = torch.autograd.grad(want, logits)
    assert torch.allclose(got, want, rtol=1e-12, atol=0) and float(got.detach()) > 0
    assert torch.allclose(g_got, g_want, rtol=1e-10, atol=1e-15)
    assert float(g_got[real == 0].abs().max()) == 0  # padding tokens get no gradient


@pytest.mark.parametrize("parts", [2, 3])
def test_split_over_ranks_the_parts_add_up_to_the_whole(parts):
    """Tokens dealt to ``parts`` ranks (any order, as zig-zag CP slices and SP row blocks deal them): each rank's loss
    with the counts summed over the ranks (``reduce``) adds up to the whole loss, and each rank's logits get exactly
    their gradient. Without the sum, the parts do not add up."""
    logits, idx, real, seq = _batch([7, 2, 11], seed=1)
    whole = seq_aux_loss(logits, idx, real, SequenceBalance(seq, 3), COEF, K)
    (g_whole,) = torch.autograd.grad(whole, logits)
    whole = whole.detach()
    shares = torch.randperm(len(seq), generator=torch.Generator().manual_seed(2)).chunk(parts)
    stats = []

    def record(x):
        stats.append(x.clone())
        return x
    for r in shares:  # each rank's own statistics first, as an all-reduce gathers them
        seq_aux_loss(logits[r].detach(), idx[r], real[r], SequenceBalance(seq[r], 3, record), COEF, K)
    summed = torch.stack(stats).sum(0)
    total, grad = 0.0, torch.zeros_like(logits)
    for r in shares:
        loss = seq_aux_loss(logits[r], idx[r], real[r], SequenceBalance(seq[r], 3, lambda x: summed.clone()), COEF, K)
        grad[r] = torch.autograd.grad(loss, logits)[0][r]
        total += float(loss.detach())
    assert abs(total - float(whole)) <= 1e-12 * float(whole)
    assert torch.allclose(grad, g_whole, rtol=1e-10, atol=1e-15)
    alone = sum(float(seq_aux_loss(logits[r].detach(), idx[r], real[r], SequenceBalance(seq[r], 3), COEF, K)) for r in shares)
    assert abs(alone - float(whole)) > 1e-3 * float(whole)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=5), st.integers(0, 2**16))
def test_a_pack_balances_each_of_its_sequences_on_its_own(lengths, seed):
    """The pack's loss is the sum of its sequences' losses, each computed alone (Megatron-LM issue #6108 took the
    pack for one sequence: that differs once two sequences route differently)."""
    logits, idx, real, seq = _batch(lengths, seed=seed)
    logits = logits.detach()
    packed = float(seq_aux_loss(logits, idx, real, SequenceBalance(seq, len(lengths)), COEF, K))
    alone = sum(float(seq_aux_loss(logits[seq == s], idx[seq == s], real[seq == s],
                                   SequenceBalance(torch.zeros(int((seq == s).sum()), dtype=torch.long), 1), COEF, K))
                for s in range(len(lengths)))
    assert abs(packed - alone) <= 1e-12 * max(1.0, alone)


def test_bad_sequence_ids_and_a_missing_layout_are_refused():
    logits, idx, real, seq = _batch([3, 4])
    with pytest.raises(BalanceError, match=r"got \(5,\) sequence ids for 11 tokens"):
        seq_aux_loss(logits, idx, real, SequenceBalance(seq[:5], 2), COEF, K)
    with pytest.raises(BalanceError, match=r"sequence ids must lie in \[0, 1\), got \[0, 1\]"):
        SequenceBalance(seq, 1)
    with pytest.raises(BalanceError, match=r"seq_T must be a 1-d integer tensor"):
        SequenceBalance(seq.float(), 2)
    model = TinyLM(ModelConfig(experts=4, top_k=2, aux_loss=1e-2))
    t = torch.arange(6)
    with pytest.raises(BalanceError, match=r"MoE layer \d+ has a load-balancing loss .* pass balance="):
        model.run_layers(model.embed_tokens(t), t, torch.ones(6), lambda q, k, v: thd_attention(q, k, v, [0, 6]))


def test_a_packs_tokens_are_numbered_by_their_sequence_and_a_foreign_id_is_refused():
    from types import SimpleNamespace

    from harness.train.passes import balance_sequences

    mb = SimpleNamespace(index=0, gids=(7, 2, 5), data={"seq": torch.tensor([7, 7, 2, 5, 5, 5])})
    seq, n = balance_sequences(mb)
    assert seq.tolist() == [0, 0, 1, 2, 2, 2] and n == 3  # pack order, whatever the gids
    mb.data["seq"] = torch.tensor([7, 3, 5])
    with pytest.raises(BalanceError, match=r"outside its pack \(7, 2, 5\)"):
        balance_sequences(mb)
    with pytest.raises(BalanceError, match=r"sequences must be an int >= 1"):
        SequenceBalance(torch.zeros(0, dtype=torch.long), 0)


def test_configurations_that_cannot_have_it_are_refused():
    with pytest.raises(ValueError, match=r"aux_loss=-1 must be a number >= 0"):
        ModelConfig(experts=4, aux_loss=-1)
    with pytest.raises(ValueError, match=r"aux_loss=True must be a number >= 0"):
        ModelConfig(experts=4, aux_loss=True)
    with pytest.raises(ValueError, match=r"aux_loss=0.1 balances MoE routers and this model has none"):
        ModelConfig(aux_loss=0.1)
    with pytest.raises(LayoutError, match=r"moe_aux_loss=0.01 balances MoE routers and model 'tiny-gpt' has none"):
        TrainConfig(model="tiny-gpt", moe_aux_loss=0.01).validate(2)
    with pytest.raises(LayoutError, match=r"moe_aux_loss must be a number >= 0 .* got nan"):
        TrainConfig(model="tiny-moe", moe_aux_loss=float("nan")).validate(2)
    assert TrainConfig(model="tiny-moe", moe_aux_loss=0.01).model_config().aux_loss == 0.01
    assert TrainConfig(model="tiny-moe").model_config() is MODELS["tiny-moe"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"-1 is below the minimum 0"):
        AUX_COEF("-1")
