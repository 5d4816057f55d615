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
