"""``harness.runtime.opaque``: attention as one operator that ``torch.compile`` does not trace.

The operator must be the installed attention exactly (forward and gradients, bit for bit in eager
mode, through a compiled graph to rounding), keep no graph it does not need, and refuse misuse
with a clear error instead of a silent wrong gradient."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from harness.runtime import opaque
from harness.runtime.opaque import OpaqueAttentionError, attending, opaque_attention


def _causal(q, k, v):  # [T, H, D], GQA-free causal attention with autograd
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True).transpose(0, 1)


def _qkv(T=12, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def _grads(fn, qkv, w):
    out = fn(*qkv)
    return (out.detach(), *torch.autograd.grad((out * w).sum(), qkv))


def test_eager_operator_is_the_attention_bit_for_bit():
    qkv = _qkv()
    w = torch.randn(12, 2, 8, dtype=torch.float64)
    ref = _grads(_causal, qkv, w)
    with attending(_causal):
        got = _grads(opaque_attention, qkv, w)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert opaque.pending() == 0  # the backward took its graph back


def test_compiled_graph_with_two_operators_matches_eager_and_reads_the_attention_at_run_time():
    """One compiled function calls the operator twice (two layers); it runs with two different
    attentions without recompiling for them (the attention is read when the forward runs), for two
    token counts, and the gradients of every input match eager."""
    torch._dynamo.reset()

    def layers(x, w1, w2):
        h = x + opaque_attention(x * w1, x, x)
        return h + opaque_attention(h * w2, h, h)

    def plain(att):
        return lambda x, w1, w2: (lambda h: h + att(h * w2, h, h))(x + att(x * w1, x, x))

    def half(q, k, v):  # another attention: scaled causal
        return 0.5 * _causal(q, k, v)

    compiled = torch.compile(layers, backend="aot_eager", fullgraph=True)  # one graph: no break at the operator
    for T in (10, 14):
        x = torch.randn(T, 2, 4, dtype=torch.float64, requires_grad=True)
        w1, w2 = (torch.randn(T, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
        for att in (_causal, half):
            ref = _grads(plain(att), (x, w1, w2), torch.ones(()))
            with attending(att):
                got = _grads(compiled, (x, w1, w2), torch.ones(()))
            for a, b in zip(ref, got):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert opaque.pending() == 0


def test_backward_runs_in_the_order_autograd_asks_for():
    """Two forwards, then their backwards in the reverse order (a pipeline schedule): each takes
    its own graph."""
    a, b = _qkv(seed=1), _qkv(seed=2)
    with attending(_causal):
        oa, ob = opaque_attention(*a), opaque_attention(*b)
    gb = torch.autograd.grad(ob.sum(), b)
    ga = torch.autograd.grad(oa.sum(), a)
    for got, qkv in ((ga, a), (gb, b)):
        ref = torch.autograd.grad(_causal(*qkv).sum(), qkv)
        for x, y in zip(got, ref):
            assert torch.equal(x, y)


def test_a_forward_without_backward_keeps_nothing():
    before = opaque.pending()
    with attending(_causal):
        out = opaque_attention(*_qkv())
    assert opaque.pending() == before + 1
    del out
    gc.collect()
    assert opaque.pending() == before
    with torch.no_grad(), attending(_causal):  # nothing requires grad: nothing kept at all
        opaque_attention(*[t.detach() for t in _qkv()])
    assert opaque.pending() == before


def test_misuse_is_refused_by_name():
    with pytest.raises(OpaqueAttentionError, match="attending"):
        opaque_attention(*_qkv())
    with pytest.raises(TypeError, match="callable"):
        with attending("flash"):
            pass
    with attending(_causal):
        out = opaque_attention(*_qkv())
    loss = out.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(OpaqueAttentionError, match="retain_graph"):
        loss.backward()


def test_double_backward_and_aliased_outputs_are_refused_by_name():
    """The operator promises fresh outputs (a compiled graph may reuse an input's buffer after the
    call): an attention whose output shares memory with an input is refused, and counts no forward;
    a gradient that shares memory (passed straight through, or views of one stacked buffer) is
    copied, giving eager's gradients; a backward through the gradients is refused
    (``create_graph=True`` still gives first-order gradients)."""
    qkv = _qkv()
    with attending(_causal):
        out = opaque_attention(*qkv)
    grads = torch.autograd.grad(out.sum(), qkv, create_graph=True)
    for g, ref in zip(grads, torch.autograd.grad(_causal(*qkv).sum(), qkv)):
        assert torch.equal(g.detach(), ref)
    with pytest.raises(OpaqueAttentionError, match="double backward"):
        torch.autograd.grad(sum(g.sum() for g in grads), qkv)
    calls = opaque.forward_calls()
    with pytest.raises(OpaqueAttentionError, match="shares memory"), attending(lambda q, k, v: q.view_as(q)):
        opaque_attention(*qkv)
    assert opaque.forward_calls() == calls and opaque.pending() == 0
    for att in (lambda q, k, v: _causal(q, k, k) + v,  # dV is the incoming gradient, passed straight through
                lambda q, k, v: _causal(q, *torch.stack([k, v]))):  # dK, dV: views of one buffer
        with attending(att):
            out = opaque_attention(*qkv)
        grad_out = torch.randn_like(out)
        got = torch.autograd.grad(out, qkv, grad_out)
        for g, ref in zip(got, torch.autograd.grad(att(*qkv), qkv, grad_out)):
            assert torch.equal(g, ref)
        ptrs = [g.untyped_storage().data_ptr() for g in got] + [grad_out.untyped_storage().data_ptr()]
        assert len(set(ptrs)) == 4


def test_attending_restores_the_previous_attention():
    qkv = _qkv()
    with attending(_causal):
        with attending(lambda q, k, v: 2 * _causal(q, k, v)):
            inner = opaque_attention(*qkv)
        outer = opaque_attention(*qkv)
    torch.testing.assert_close(inner, 2 * outer)


class _Autocasting(torch.autograd.Function):
    """Identity that records whether CPU autocast was on in its forward and in its backward."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        _Autocasting.seen.append(("forward", torch.is_autocast_enabled("cpu")))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Autocasting.seen.append(("backward", torch.is_autocast_enabled("cpu")))
        return g


def _recording(q, k, v):
    return _causal(_Autocasting.apply(q), k, v)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_the_operator_runs_the_attention_in_the_dispatch_state_eager_code_has(autocast):
    """The reference is eager: the attention's forward under the caller's autocast, its backward (called outside
    autocast, as a step calls it) without. The operator must see the same states, whatever the state of the code
    that first imported it (a bf16 step imports it under autocast): the forward takes the state of the code that
    installed the attention, the backward a new thread's."""
    qkv = [t.detach().float().requires_grad_() for t in _qkv()]
    runs = {}
    for name, fn in (("eager", _recording), ("opaque", opaque_attention)):
        _Autocasting.seen = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), attending(_recording):  # as the chain
            out = fn(*qkv)
        out.float().sum().backward()
        runs[name] = list(_Autocasting.seen)
    assert runs["opaque"] == runs["eager"] == [("forward", autocast), ("backward", False)], runs
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the backward's state does not depend on where it is read
        assert opaque._default_dispatch_state() == opaque._BACKWARD_DISPATCH
