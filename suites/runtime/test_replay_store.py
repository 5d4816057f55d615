"""The replay store and routing modes of the tiny MoE (single process)."""

from __future__ import annotations

import pytest
import torch

from harness.runtime.attention import thd_attention
from harness.runtime.model import ModelConfig, TinyLM
from harness.runtime.replay import ReplayError, ReplayStore, Routing

CFG = ModelConfig(experts=4, top_k=2, layers=3)


def run(model, tokens, routing):
    n = len(tokens) - 1
    t = torch.as_tensor(tokens)
    ce, aux = model.token_losses(t[:-1], t[1:], torch.ones(n), torch.arange(n),
                                 lambda q, k, v: thd_attention(q, k, v, [0, n]), routing=routing)
    return ce + aux


def test_record_then_replay_reproduces_the_forward_and_reaches_the_router():
    torch.manual_seed(0)
    model, toks = TinyLM(CFG), torch.randint(0, 256, (33,)).tolist()
    store = ReplayStore()
    ref = run(model, toks, Routing("record", store))
    assert store.keys() == [(1, 0, 0), (2, 0, 0)]  # global layer numbers of the MoE blocks
    with torch.no_grad():  # perturb a router: free routing changes, replayed routing does not
        model.blocks[1].mlp.router.weight.add_(torch.randn(model.blocks[1].mlp.router.weight.shape))
    replay = Routing("replay", store)
    loss = run(model, toks, replay)
    assert torch.equal(replay.chosen[1], store.get(1, 0, 0))
    free = Routing("free")
    run(model, toks, free)
    assert not torch.equal(free.chosen[1], store.get(1, 0, 0))
    loss.backward()
    assert model.blocks[1].mlp.router.weight.grad.abs().sum() > 0  # gates use the live scores
    fresh = TinyLM(CFG)
    assert torch.allclose(run(fresh, toks, Routing("replay", store)), ref.detach())


def test_store_errors_name_the_key_and_shapes():
    store = ReplayStore()
    with pytest.raises(ReplayError, match="no replay data for layer 2, micro-batch 0, CP rank 1"):
        store.get(2, 0, 1)
    with pytest.raises(ReplayError, match=r"must be \[tokens, top_k\]"):
        store.put(1, 0, 0, torch.zeros(3))
    store.put(1, 0, 0, torch.zeros(5, 2, dtype=torch.int64))
    model = TinyLM(CFG)
    with pytest.raises(ReplayError, match="replay data is \\(5, 2\\), the router sees 32 tokens"):
        run(model, list(range(33)), Routing("replay", store))
    with pytest.raises(ReplayError, match="needs a ReplayStore"):
        Routing("replay")
    with pytest.raises(ReplayError, match="free, record or replay"):
        Routing("rollout")


def test_padding_positions_replay_distinct_experts_and_stay_out_of_the_loss():
    """A THD micro-batch of two sequences padded to 8 tokens each (``harness.plan.replay.thd_routes``):
    every replayed row, padding included, holds top_k distinct experts, and the loss does not depend on
    which experts the padding rows name (the padding is masked out of the loss and attended by no real
    token)."""
    import numpy as np

    from harness.plan.replay import thd_routes

    torch.manual_seed(0)
    model, K = TinyLM(CFG), CFG.top_k
    rng = np.random.default_rng(0)
    lens, cu = [5, 7], [0, 8, 16]
    samples = [np.stack([np.stack([rng.permutation(4)[:K] for _ in range(3)]) for _ in range(n)]) for n in lens]
    tok = torch.randint(0, 256, (16,))
    real = torch.tensor([1] * 5 + [0] * 3 + [1] * 7 + [0])
    pos = torch.tensor(list(range(8)) * 2)

    def loss(rows):
        store = ReplayStore()
        for layer in (1, 2):
            store.put(layer, 0, 0, torch.as_tensor(rows[:, layer]))
        routing = Routing("replay", store)
        ce, aux = model.token_losses(tok, tok.roll(-1), real, pos, lambda q, k, v: thd_attention(q, k, v, cu),
                                     routing=routing)
        return ce + aux, routing

    rows = thd_routes(samples, cu)
    ref, routing = loss(rows)
    for layer in (1, 2):
        assert all(len(set(r)) == K for r in routing.chosen[layer].tolist())
        assert routing.chosen[layer][5:8].tolist() == [list(range(K))] * 3  # the padding rows: 0 .. K-1
    other = rows.copy()
    other[5:8], other[15] = [3, 2], [2, 1]  # other distinct experts on the padding rows only
    assert torch.equal(loss(other)[0], ref)
