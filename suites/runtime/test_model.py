"""Tiny GPT / MoE: deterministic init, RoPE by global positions, padding-independent aux loss, and a
loss that falls when trained on the synthetic corpus."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.data.corpus import CorpusConfig, global_batch
from harness.plan.thd import pack
from harness.runtime.attention import thd_attention
from harness.runtime.model import MODELS, ModelConfig, TinyLM, rope


def attention_for(cu):
    return lambda q, k, v: thd_attention(q, k, v, cu)


def test_init_is_deterministic_and_seeded():
    a, b = TinyLM(MODELS["tiny-gpt"]), TinyLM(MODELS["tiny-gpt"])
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = TinyLM(ModelConfig(seed=1))
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_rope_uses_global_positions():
    x = torch.randn(16, 2, 8)
    pos = torch.arange(16)
    idx = torch.tensor([2, 3, 12, 13])  # a zig-zag slice
    assert torch.allclose(rope(x, pos, 1e4)[idx], rope(x[idx], pos[idx], 1e4))


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-moe"])
def test_padding_changes_nothing(name):
    model = TinyLM(MODELS[name])
    toks = torch.randint(0, 256, (21,))
    x, y, pos = toks[:-1], toks[1:], torch.arange(20)
    ce, aux = model.token_losses(x, y, torch.ones(20), pos, attention_for([0, 20]))
    xp = torch.cat([x, torch.zeros(12, dtype=x.dtype)])
    yp = torch.cat([y, torch.full((12,), -100)])
    mp = torch.cat([torch.ones(20), torch.zeros(12)])
    ce_p, aux_p = model.token_losses(xp, yp, mp, torch.arange(32), attention_for([0, 32]))
    assert torch.allclose(ce, ce_p, atol=1e-5) and torch.allclose(aux, aux_p, atol=1e-7)
    assert (aux > 0) == (name == "tiny-moe")


def test_moe_config_is_checked():
    with pytest.raises(ValueError, match="top_k=5 must be in"):
        ModelConfig(experts=4, top_k=5)
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(hidden=66)


def test_the_router_computes_in_fp32_under_bf16_autocast_and_keeps_fp64():
    """Megatron's moe_router_dtype=fp32. Autocast runs F.linear in bf16 whatever its inputs' dtype, so the
    router must leave autocast: its z-loss under bf16 autocast equals the fp32 one bit for bit. An fp64
    model keeps fp64 (rounded to fp32, a one-token batch's logits take another BLAS kernel on CPU)."""
    from harness.runtime.layers import MoE

    cfg = ModelConfig(experts=4, top_k=2, hidden=16, ffn=24, z_loss=1.0)
    moe, x, real = MoE(cfg, layer=1), torch.randn(7, 16), torch.ones(7)
    _, z32 = moe(x, real)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, z_bf16 = moe(x, real)
    assert z_bf16.dtype == torch.float32 and torch.equal(z_bf16, z32)
    moe64, x64 = moe.double().requires_grad_(False), x.double()
    _, z64 = moe64(x64, real.double())
    logits = x64 @ moe64.router.weight.T
    assert z64.dtype == torch.float64
    assert abs(z64.item() - torch.logsumexp(logits, -1).pow(2).sum().item()) <= 1e-13 * z64.item()


@pytest.mark.parametrize("kw, match", [
    ({"mtp_depth": -1}, r"mtp_depth=-1 must be an int >= 0"),
    ({"mtp_depth": 1.5}, r"mtp_depth=1.5 must be an int"),
    ({"mtp_weight": -0.1}, r"mtp_weight=-0.1 must be >= 0"),
    ({"layers": 4, "pattern": "M*X-"}, r"pattern='M\*X-' must have one of 'M', '\*', '-' per layer \(4 layers\); "
                                       r"unknown \['X'\]"),
    ({"layers": 4, "pattern": "M*-"}, r"pattern='M\*-' must have one of .* per layer \(4 layers\)$"),
    ({"layers": 2, "pattern": "M*", "experts": 4}, "a hybrid pattern has no MoE layers"),
    ({"ssm_heads": 0, "ssm_chunk": 0}, "ssm_heads=0, ssm_chunk=0: SSM sizes must be >= 1"),
])
def test_mtp_and_hybrid_configs_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kw)


def test_loss_falls_on_the_corpus():
    """One THD pack per step (8 sequences of 64 tokens), single process."""
    corpus = CorpusConfig(sequences_per_batch=8, lengths="const:value=64")
    model = TinyLM(MODELS["tiny-gpt"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    p = pack([64] * 8)
    losses = []
    for step in range(40):
        seqs = [torch.as_tensor(s) for s in global_batch(corpus, step)]
        x, y = torch.cat([s[:-1] for s in seqs]), torch.cat([s[1:] for s in seqs])
        pos = torch.arange(64).repeat(8)
        ce, _ = model.token_losses(x, y, torch.ones(512), pos, attention_for(p.cu_seqlens_padded))
        (ce / 512).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(ce.detach()) / 512)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3  # ~0.45 nats in practice


def test_corpus_is_deterministic_and_structured():
    c = CorpusConfig(vocab=64, sequences_per_batch=40, lengths="const:value=100", seed=3)
    a, b = global_batch(c, 5), global_batch(c, 5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, global_batch(c, 6)))
    assert all(len(x) == 101 and x.min() >= 0 and x.max() < 64 for x in a)
    periodic = [x for x in a if any(np.array_equal(x[p:], x[:-p]) for p in range(4, 33))]
    assert 5 <= len(periodic) <= 35  # about half are copy sequences


def _losses_and_grads(model, lengths, seed=0):
    from harness.plan.thd import whole_chunks
    from harness.runtime.attention import DeviceChunks, chunk_attention

    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, model.c.vocab, (cu[-1],), generator=g)
    pos = torch.cat([torch.arange(L) for L in lengths])
    mask = (torch.rand(cu[-1], generator=g) > 0.1).to(torch.int64)
    chunks = DeviceChunks.build(whole_chunks(cu), "cpu")
    model.zero_grad()
    ce, _ = model.token_losses(toks, toks.roll(-1), mask, pos, lambda q, k, v: chunk_attention(q, k, v, chunks))
    ce.backward()
    return ce.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compiled_matches_eager(backend, mlp, tol, scope="segments"):
    from dataclasses import replace

    from torch._dynamo.utils import counters

    from harness.runtime import model as model_module
    from harness.runtime import opaque

    m = TinyLM(replace(MODELS["tiny-gpt"], mlp=mlp))
    eager = [_losses_and_grads(m, L, seed) for seed, L in enumerate(([7, 30, 64], [5, 3], [128]))]
    torch._dynamo.reset()  # fresh compilations, so the counter below sees this test's graphs
    model_module._compiled_segments.clear()
    m.compile_blocks(backend, scope=scope)
    try:  # three token counts: the compiled segments re-specialise (then go dynamic) and stay right
        for seed, L in enumerate(([7, 30, 64], [5, 3], [128])):
            ce, grads = _losses_and_grads(m, L, seed)
            ce0, grads0 = eager[seed]
            assert ce.item() == pytest.approx(ce0.item(), rel=tol)
            for n, g in grads.items():
                assert torch.allclose(g, grads0[n], rtol=tol, atol=tol * grads0[n].abs().max().item()), n
        # the compiled path really ran, as one chain: attention inputs, then per stretch between two
        # attentions one segment (MLP + residuals + the next block's inputs), the last with the loss head
        if scope == "chain":  # one graph for the whole model; every forward graph went back
            assert {k[0] for k in model_module._compiled_segments} == {"chain"}
            assert opaque.pending() == 0
        else:
            assert counters["stats"]["unique_graphs"] >= 3, dict(counters["stats"])
            assert {k[0] for k in model_module._compiled_segments} == {"attn_inputs", f"{mlp}+attn_inputs",
                                                                      f"{mlp}+head"}
    finally:
        m.compile_blocks(None)
    ce, grads = _losses_and_grads(m, [7, 30, 64], 0)
    assert ce.item() == eager[0][0].item()  # back to eager: bit for bit


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_compiled_blocks_compute_the_eager_model(mlp):
    """The compiled segments (``TinyLM.compile_blocks``) are the eager block's maths: traced by
    AOTAutograd (``aot_eager``), loss and every gradient agree with eager to fp32 rounding."""
    _compiled_matches_eager("aot_eager", mlp, 1e-5)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_compiled_chain_computes_the_eager_model(mlp):
    """``scope="chain"``: the whole model as one compiled graph with opaque attentions, loss and
    every gradient as eager (fp32 rounding), for three token counts (static, then dynamic shapes)."""
    _compiled_matches_eager("aot_eager", mlp, 1e-5, scope="chain")


@pytest.mark.slow
def test_compiled_blocks_with_inductor_compute_the_eager_model():
    """Inductor's generated kernels (C++ on the CPU) agree too (slow: ~30 s of compilation)."""
    _compiled_matches_eager("inductor", "gelu", 1e-4)


@pytest.mark.parametrize("scope", ["segments", "chain"])
def test_compiled_layer_ranges_compute_the_eager_blocks(scope):
    """A pipeline stage's range of blocks (``run_layers(layers=...)``) through the compiled chain
    gives the eager hidden states and gradients; a single block alone too (``Block.forward``)."""
    from dataclasses import replace

    from harness.plan.thd import whole_chunks
    from harness.runtime import model as model_module
    from harness.runtime.attention import DeviceChunks, chunk_attention
    from harness.runtime.model import Rotary

    m = TinyLM(replace(MODELS["tiny-gpt"], layers=3))
    g = torch.Generator().manual_seed(3)
    lengths = [9, 21]
    cu = [0, 9, 30]
    pos = torch.cat([torch.arange(L) for L in lengths])
    chunks = DeviceChunks.build(whole_chunks(cu), "cpu")
    attn = lambda q, k, v: chunk_attention(q, k, v, chunks)  # noqa: E731
    x0 = torch.randn(30, m.c.hidden, generator=g)

    def run(call):
        m.zero_grad()
        x = x0.clone().requires_grad_(True)
        h = call(x)
        (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
        return h.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    calls = {"stage": lambda x: m.run_layers(x, pos, None, attn, layers=[1, 2])[0],
             "block": lambda x: m.blocks[0](x, Rotary(pos, m.c.hidden // m.c.heads, m.c.rope_base), None, attn)[0]}
    eager = {k: run(c) for k, c in calls.items()}
    torch._dynamo.reset()
    model_module._compiled_segments.clear()
    m.compile_blocks("aot_eager", scope=scope)
    try:
        for k, c in calls.items():
            h, gx, grads = run(c)
            assert torch.allclose(h, eager[k][0], rtol=1e-5, atol=1e-6), k
            assert torch.allclose(gx, eager[k][1], rtol=1e-5, atol=1e-6), k
            assert grads.keys() == eager[k][2].keys(), k
            for n, gr in grads.items():
                assert torch.allclose(gr, eager[k][2][n], rtol=1e-5, atol=1e-5 * eager[k][2][n].abs().max().item()), n
        assert {k[0] for k in model_module._compiled_segments} == (
            {"chain"} if scope == "chain" else {"attn_inputs", "swiglu+attn_inputs", "swiglu"})
    finally:
        m.compile_blocks(None)


def test_compile_blocks_refuses_a_non_backend():
    with pytest.raises(TypeError, match="backend"):
        TinyLM(MODELS["tiny-gpt"]).compile_blocks(3)


def test_training_cost_prices_the_mlp_the_model_runs():
    """SwiGLU is three matmuls (gated), GeLU two; a dense model ignores ``top_k``, MoE runs ``top_k``
    experts' MLPs per token. (The convergence runs once priced tiny-gpt's SwiGLU as two matmuls of
    twice the width.)"""
    from harness.plan.cost import CostModel
    from harness.runtime.model import MODELS, ModelConfig

    def mlp_linear(m: ModelConfig) -> float:  # the MLP's share of the per-token cost
        no_mlp = CostModel.from_model_shape(num_layers=m.layers, hidden_size=m.hidden, ffn_hidden_size=1,
                                            num_attention_heads=m.heads, num_query_groups=m.kv_heads,
                                            gated_mlp=m.mlp == "swiglu", vocab_size=m.vocab)
        return m.training_cost().linear - no_mlp.linear

    per_matrix = lambda m, width: 3 * 2 * m.layers * m.hidden * width  # noqa: E731  (fwd + bwd = 3 x fwd)
    gpt, moe = MODELS["tiny-gpt"], MODELS["tiny-moe"]
    assert gpt.mlp == "swiglu" and gpt.experts == 0 and gpt.top_k == 2
    assert mlp_linear(gpt) == pytest.approx(3 * per_matrix(gpt, gpt.ffn - 1))
    assert mlp_linear(moe) == pytest.approx(3 * per_matrix(moe, moe.top_k * moe.ffn - 1))
    gelu = ModelConfig(mlp="gelu")
    assert mlp_linear(gelu) == pytest.approx(2 * per_matrix(gelu, gelu.ffn - 1))


def test_per_token_losses_sum_to_the_summed_loss_bit_for_bit():
    """``token_losses(per_token=True)`` (the fault catalogue's probes) returns the same sum, and each
    padding token's entry is 0."""
    from harness.runtime.attention import thd_attention
    from harness.runtime.model import MODELS, TinyLM

    torch.manual_seed(0)
    model = TinyLM(MODELS["tiny-gpt"])
    x, y = torch.randint(0, 256, (24,)), torch.randint(0, 256, (24,))
    mask = torch.ones(24, dtype=torch.int64)
    mask[20:] = 0
    attention = lambda q, k, v: thd_attention(q, k, v, [0, 24])  # noqa: E731
    ce, aux = model.token_losses(x, y, mask, torch.arange(24), attention)
    ce2, aux2, ce_T = model.token_losses(x, y, mask, torch.arange(24), attention, per_token=True)
    assert torch.equal(ce, ce2) and torch.equal(aux, aux2) and torch.equal(ce_T.sum(), ce.detach())
    assert ce_T.shape == (24,) and not ce_T.requires_grad and torch.all(ce_T[20:] == 0)
