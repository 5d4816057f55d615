"""``harness.runtime.weight_cache``: a step's matrix weights copied to the compute dtype once, their gradients added
into ``.grad`` in place - the same numbers as autocast's cast per call and autograd's accumulation, bit for bit.

The reference is the per-call path (``weights="per-call"``: what torch does without this module), run on the same
model, inputs and micro-batches."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from harness.plan.thd import whole_chunks
from harness.runtime import weight_cache as wc
from harness.runtime.attention import DeviceChunks, chunk_attention
from harness.runtime.model import MODELS, TinyLM
from harness.train.config import TrainConfig
from harness.train.layouts import LayoutError

MICRO_BATCHES = ([7, 30, 64], [5, 3], [128])


def _step_grads(model, mode: str, bf16: bool, steps: int = 1, flat: bool = False,
                device: str = "cpu") -> tuple[list[float], dict]:
    """``steps`` steps of three micro-batches (backward each, gradients accumulating), an SGD update between steps;
    returns every micro-batch's loss and the last step's gradients. ``flat``: the gradients are views of one flat
    buffer, as the training step's (``GradBuffer``). ``device``: where the model is (its inputs are made there)."""
    from harness.parallel.grad_reduce import GradBuffer

    losses = []
    buffer = GradBuffer(model.parameters()) if flat else None
    for step in range(steps):
        if buffer is not None:
            buffer.zero_()
        else:
            model.zero_grad(set_to_none=False) if step else model.zero_grad(set_to_none=True)
        with wc.cached_weights(mode):
            for seed, lengths in enumerate(MICRO_BATCHES):
                cu = [0]
                for n in lengths:
                    cu.append(cu[-1] + n)
                g = torch.Generator().manual_seed(seed)
                toks = torch.randint(0, model.c.vocab, (cu[-1],), generator=g).to(device)
                pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
                mask = (torch.rand(cu[-1], generator=g) > 0.1).to(torch.int64).to(device)
                chunks = DeviceChunks.build(whole_chunks(cu), device)
                with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                    ce, aux = model.token_losses(toks, toks.roll(-1), mask, pos,
                                                 lambda q, k, v: chunk_attention(q, k, v, chunks))
                (ce + aux).backward()
                losses.append(ce.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if step + 1 < steps:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(0.5 * p.grad)  # a large step: a stale copy would show at once
    return losses, grads


def _both(model_name: str, bf16: bool, steps: int = 1, compiled: str | None = None, modes=("per-call", "cached"),
          flat: bool = False, device: str = "cpu"):
    """Each mode's ``_step_grads`` on a fresh model; the copies and the fused GEMM are checked to have run (an
    equality of two per-call runs would prove nothing)."""
    from harness.runtime import fused_linear

    out = {}
    for mode in modes:
        wc.release()
        gemms = []
        original = fused_linear.gemm_accumulate
        fused_linear.gemm_accumulate = lambda mg, go, x, _o=original: (gemms.append(1), _o(mg, go, x))[1]
        m = TinyLM(MODELS[model_name]).to(device)
        if compiled:
            m.compile_blocks("aot_eager", scope=compiled)
        try:
            out[mode] = _step_grads(m, mode, bf16, steps, flat, device)
        finally:
            m.compile_blocks(None)
            fused_linear.gemm_accumulate = original
        assert (wc.held_bytes() > 0) == (mode != "per-call") and bool(gemms) == (mode == "fused"), mode
    return tuple(out[m] for m in modes)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_name", ["tiny-gpt", "tiny-moe"])
def test_cached_weights_give_the_per_call_numbers_bit_for_bit(model_name, bf16):
    """Two steps of three micro-batches: every loss and every accumulated gradient equal the per-call path's
    exactly, in fp32 and under bf16 autocast, for the dense and the MoE model (its dense block)."""
    (loss_a, grads_a), (loss_b, grads_b) = _both(model_name, bf16, steps=2)
    assert loss_a == loss_b
    assert grads_a.keys() == grads_b.keys()
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n


@pytest.mark.parametrize("scope", ["segments", "chain"])
def test_compiled_model_takes_the_copies_too(scope):
    """The compiled segments and the compiled chain (``aot_eager``) take the step's bf16 copies as inputs: losses
    and gradients equal the compiled per-call model's bit for bit."""
    from harness.runtime import model as model_module

    torch._dynamo.reset()
    model_module._compiled_segments.clear()
    (loss_a, grads_a), (loss_b, grads_b) = _both("tiny-gpt", True, steps=2, compiled=scope)
    assert loss_a == loss_b
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n


def test_mtp_head_used_twice_adds_each_use():
    """Under multi-token prediction the LM head serves every depth: each use adds its own gradient (autograd sums
    the uses first), so the gradients agree to fp32 rounding, not bit for bit."""
    (loss_a, grads_a), (loss_b, grads_b) = _both("tiny-gpt-mtp", False)
    assert loss_a == loss_b
    for n in grads_a:
        assert torch.allclose(grads_a[n], grads_b[n], rtol=1e-6, atol=1e-7 * grads_a[n].abs().max().item()), n


def test_one_copy_per_step_refreshed_when_the_weight_changes():
    """A weight is copied at its first use in a step and not again while it is unchanged; a new step copies it
    again, and so does an in-place change within the step (its version counter moved)."""
    w = torch.nn.Parameter(torch.randn(8, 4))
    copies = []
    original = wc.refresh

    def counting(w_, buf, first):
        copies.append(first)
        original(w_, buf, first)

    wc.refresh = counting
    try:
        for _ in range(2):
            with wc.cached_weights():
                for _ in range(3):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        a = wc.weight(w)
                assert a.dtype == torch.bfloat16
        assert copies == [True, False]  # one copy per step; the buffer is kept
        with wc.cached_weights():
            wc.weight(w)
            with torch.no_grad():
                w.mul_(2.0)
            b = wc.weight(w)
        assert len(copies) == 4 and torch.equal(b, w.detach())  # fp32: the copy is the weight, exactly
    finally:
        wc.refresh = original


def test_outside_a_step_and_for_what_takes_no_copy_the_weight_itself():
    w = torch.nn.Parameter(torch.randn(8, 4))
    assert wc.weight(w) is w  # no step open
    with wc.cached_weights():
        vec = torch.nn.Parameter(torch.randn(8))
        frozen = torch.randn(8, 4)
        assert wc.weight(vec) is vec and wc.weight(frozen) is frozen  # 1-d, no gradient
        with torch.no_grad():
            assert wc.weight(w) is w  # evaluation inside a step: nothing to accumulate
    with wc.cached_weights("per-call"):
        assert wc.weight(w) is w  # per-call


def test_hooks_fire_once_per_use_as_autograd_fires_them():
    """The overlapped reducer counts each parameter in by its post-accumulate-grad hook: with the copies the hook
    fires once per micro-batch, after the gradient is in ``.grad``, as autograd's own accumulation fires it."""
    w = torch.nn.Parameter(torch.randn(8, 4))
    for mode in wc.MODES:
        w.grad = torch.zeros_like(w)
        seen = []
        handle = w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.abs().sum().item()))
        with wc.cached_weights(mode):
            for _ in range(3):
                wc.linear(torch.ones(2, 4), wc.weight(w)).sum().backward()
        handle.remove()
        assert len(seen) == 3 and seen[0] < seen[1] < seen[2], (mode, seen)


def test_misuse_is_refused_with_the_reason():
    with wc.cached_weights():
        with pytest.raises(wc.WeightCacheError, match="already open"):
            with wc.cached_weights():
                pass
        with pytest.raises(wc.WeightCacheError, match="inside cached_weights"):
            wc.release()
        w = torch.nn.Parameter(torch.randn(8, 4))
        y = F.linear(torch.randn(2, 4, requires_grad=True), wc.weight(w)).sum()
        with pytest.raises(wc.WeightCacheError, match="create_graph"):
            torch.autograd.grad(y, w, create_graph=True)
    with pytest.raises(ValueError, match="weight mode must be one of cached, fused, per-call, got 'fast'"):
        wc.check_mode("fast")
    with pytest.raises(LayoutError, match="weights must be one of cached, fused, per-call, got 'fast'"):
        TrainConfig(weights="fast").validate(2)


def test_the_reference_run_takes_the_per_call_path():
    """The single-process reference a run is judged against does not share the copies it judges."""
    from harness.apps import reference

    assert reference.config(TrainConfig()).weights == "per-call"
    assert TrainConfig().weights == "cached"


def test_a_freed_weight_releases_its_copy():
    wc.release()
    w = torch.nn.Parameter(torch.randn(64, 32))
    with wc.cached_weights():
        wc.weight(w)
    assert wc.held_bytes() == 64 * 32 * 4
    del w
    import gc

    gc.collect()
    assert wc.held_bytes() == 0


def test_the_dense_layers_take_their_matrices_through_the_cache():
    """Every matrix of a dense block, of each MoE expert (a dense MLP) and the LM head goes through ``weight()``
    (one copy each); the embedding, the norms and the MoE router (fp32 by design) do not."""
    wc.release()
    for name in ("tiny-gpt", "tiny-moe"):
        m = TinyLM(replace(MODELS[name]))
        _step_grads(m, "cached", bf16=False)
        held = wc.held_bytes() // 4
        expected = sum(p.numel() for n, p in m.named_parameters()
                       if p.dim() == 2 and (n.endswith(("qkv.weight", "proj.weight", "up.weight", "down.weight"))
                                            or n == "head.weight"))
        assert held == expected, name
        wc.release()


@pytest.mark.dist_cpu
def test_a_dynamic_cp_run_of_the_hybrid_model_gives_the_per_call_run_bit_for_bit(tmp_path):
    """The whole step on 2 gloo ranks (dcp: CP blocks of 1 and 2, the SSM mixer's CP exchange, the hybrid's
    attention and MLP layers), bf16 autocast: every step's loss and gradient norm equal the per-call run's; with the
    fused GEMM within bf16 rounding of them."""
    from harness.jobs.launch import run_on_ranks
    from harness.train.trainer import train

    base = {"model": "tiny-hybrid", "steps": 2, "layouts": ["dcp"], "dtype": "bfloat16", "max_seqlen_per_rank": 256,
            "corpus": {"sequences_per_batch": 8}}
    rows = {}
    for mode in wc.MODES:
        out = run_on_ranks(train, world_size=2, tmp_path=tmp_path / mode, args=({**base, "weights": mode},),
                           timeout_s=300)
        rows[mode] = out[0]["layouts"]["dcp"]
    assert any(r["cp_histogram"].get("2") for r in rows["cached"])  # a CP block of 2 ran
    for a, b, c in zip(rows["per-call"], rows["cached"], rows["fused"], strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
        assert c["loss"] == pytest.approx(a["loss"], abs=2e-3) and c["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2)


@pytest.mark.parametrize("scope", [None, "segments"])
def test_the_head_hands_its_gradient_over_first_as_without_copies(scope):
    """The overlapped reducer launches buckets in order, the LM head's (the last parameters) first, so nothing is
    reduced during the backward until the head's gradient is in. With autograd's own accumulation it is in as soon
    as the loss head's backward ran; a copy's backward node runs in the order the copy was made, so a head copy
    made before the blocks ran (as the compiled chain's head arguments once were) handed it over only at the very
    end. Eager and compiled segments (the overlapped reducer's last micro-batch; the compiled chain is one backward
    node that hands every gradient over at its end, in any order): the head's post-accumulate hook fires before any
    matrix of the first block's, with the copies as without."""
    from harness.runtime import model as model_module

    torch._dynamo.reset()
    model_module._compiled_segments.clear()
    for mode in wc.MODES:
        m = TinyLM(MODELS["tiny-gpt"])
        if scope:
            m.compile_blocks("aot_eager", scope=scope)
        order = []
        for n, p in m.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
        cu = [0, 40, 100]
        toks = torch.randint(0, m.c.vocab, (100,), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(40), torch.arange(60)])
        chunks = DeviceChunks.build(whole_chunks(cu), "cpu")
        with wc.cached_weights(mode):
            ce, _ = m.token_losses(toks, toks.roll(-1), torch.ones(100, dtype=torch.int64), pos,
                                   lambda q, k, v: chunk_attention(q, k, v, chunks))
            ce.backward()
        m.compile_blocks(None)
        first_block = min(order.index(n) for n in order if n.startswith("blocks.0.") and "norm" not in n)
        assert order.index("head.weight") < first_block and order[-1] == "embed.weight", (mode, order)


def _rel(a: torch.Tensor, b: torch.Tensor, name: str) -> float:
    """Relative L2 distance of ``a`` from ``b``; a NaN or inf is a failure (``max`` would skip a NaN after the first
    element)."""
    v = ((a - b).norm() / b.norm()).item()
    assert math.isfinite(v), (name, v)
    return v


def _close(grads_a: dict, grads_b: dict, rel: float) -> float:
    worst = max(_rel(grads_b[n], grads_a[n], n) for n in grads_a)
    assert worst <= rel, worst
    return worst


@pytest.mark.parametrize("scope", [None, pytest.param("segments", marks=pytest.mark.slow), "chain"])
def test_the_fused_gemm_accumulates_what_autograd_accumulates(scope):
    """``fused``: the weight-gradient GEMM adds into ``.grad`` itself (``harness.runtime.fused_linear``), eager and
    compiled (``aot_eager``). fp32: two steps of three micro-batches, losses and gradients within fp32 rounding of
    the per-call path (1e-6). bf16: the per-call path rounds each micro-batch's product to bf16, the fused GEMM
    does not, so neither equals the other; against the fp32 step's gradients the fused ones are no further off
    than autograd's (they are closer). The compiled segments' variant is the slow suite's (eager
    and the chain, the compiled scope ``bench step`` runs on CUDA, are in the default run)"""
    from harness.runtime import model as model_module

    torch._dynamo.reset()
    model_module._compiled_segments.clear()
    (loss_a, grads_a), (loss_b, grads_b) = _both("tiny-gpt", False, steps=2, compiled=scope, modes=("per-call", "fused"),
                                                 flat=True)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert grads_a.keys() == grads_b.keys()
    _close(grads_a, grads_b, 1e-6)
    (_, exact), = _both("tiny-gpt", False, compiled=scope, modes=("per-call",))
    (loss_c, per_call), (loss_f, fused) = _both("tiny-gpt", True, compiled=scope, modes=("per-call", "fused"))
    assert loss_c == loss_f  # the forward is the same
    err = {name: max(_rel(g[n], exact[n], n) for n in exact if n.endswith(
        ("qkv.weight", "proj.weight", "up.weight", "down.weight", "head.weight"))) for name, g in
        (("per-call", per_call), ("fused", fused))}
    assert err["fused"] <= err["per-call"], err


def test_a_gemm_that_overwrites_is_caught_by_the_gradients():
    """Plant it: ``gemm_accumulate`` writing ``go^T @ x`` instead of adding it keeps one micro-batch's gradient."""
    from harness.runtime import fused_linear

    original = fused_linear.gemm_accumulate
    fused_linear.gemm_accumulate = lambda mg, go, x: mg.copy_(go.t().to(mg.dtype) @ x.to(mg.dtype))
    try:
        (_, grads_a), (_, grads_b) = _both("tiny-gpt", False, modes=("per-call", "fused"))
    finally:
        fused_linear.gemm_accumulate = original
    with pytest.raises(AssertionError):
        _close(grads_a, grads_b, 1e-2)


def test_the_fused_mode_is_a_train_config_and_a_bench_arm():
    from harness.bench import step

    TrainConfig(weights="fused").validate(2)
    assert step.parse_arm("dcp:balanced%fused").weights == "fused"


@pytest.mark.slow
def test_the_fused_gemm_under_inductor_accumulates_what_autograd_accumulates():
    """The fused operators inside an Inductor-compiled chain (the step benchmark's default; C++ on the CPU, ~30 s of
    compilation): two steps in fp32 within fp32 rounding of the per-call path."""
    from harness.runtime import model as model_module

    torch._dynamo.reset()
    model_module._compiled_segments.clear()
    out = {}
    for mode in ("per-call", "fused"):
        m = TinyLM(MODELS["tiny-gpt"]).compile_blocks("inductor", scope="chain")
        try:
            out[mode] = _step_grads(m, mode, False, steps=2)
        finally:
            m.compile_blocks(None)
    (loss_a, grads_a), (loss_b, grads_b) = out["per-call"], out["fused"]
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    _close(grads_a, grads_b, 1e-6)
