"""Single-process attention backends: the chunked CP plan reproduces full causal attention exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.plan.thd import pack, zigzag_chunks, zigzag_index_array
from harness.runtime.attention import (
    BACKENDS,
    DeviceChunks,
    backend_available,
    chunk_attention,
    resolve_backend,
    resolve_lse_backend,
    thd_attention,
)


def dense_reference(q, k, v, cu):
    """Independent reference: a plain causal SDPA per sequence, K/V heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            qi, ki, vi = (t[a:b].transpose(0, 1) for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
            out[a:b] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1)
    return out


def qkv(T, H=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv)]


@settings(max_examples=60)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=5), lcp=st.integers(0, 3), seed=st.integers(0, 99))
def test_each_rank_chunk_attention_equals_its_slice_of_full_attention(lengths, lcp, seed):
    cp = 1 << lcp
    p = pack(lengths, 2 * cp)
    q, k, v = qkv(p.total_tokens, seed=seed)
    ref = dense_reference(q, k, v, p.cu_seqlens_padded)
    assert torch.allclose(thd_attention(q, k, v, p.cu_seqlens_padded), ref, atol=1e-12)
    for r in range(cp):
        idx = torch.as_tensor(zigzag_index_array(p.cu_seqlens_padded, cp, r))
        chunks = DeviceChunks.build(zigzag_chunks(p.cu_seqlens_padded, cp, r), "cpu")
        out = chunk_attention(q[idx], k, v, chunks, backend="sdpa")
        assert torch.allclose(out, ref[idx], atol=1e-12)


def test_unpadded_odd_lengths_without_cp():
    p = pack([7, 1, 13], 1)
    q, k, v = qkv(p.total_tokens, H=2, Hkv=2)
    assert torch.allclose(thd_attention(q, k, v, p.cu_seqlens_padded), dense_reference(q, k, v, p.cu_seqlens_padded))


def test_gradients_flow_through_the_gathered_keys():
    p = pack([12, 20], 4)
    q, k, v = (t.requires_grad_() for t in qkv(p.total_tokens))
    dense_reference(q, k, v, p.cu_seqlens_padded).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    total = [torch.zeros_like(t) for t in (q, k, v)]
    for r in range(2):  # emulate a CP block of 2: per-rank queries, shared keys
        idx = torch.as_tensor(zigzag_index_array(p.cu_seqlens_padded, 2, r))
        ql = q.detach()[idx].clone().requires_grad_()
        out = chunk_attention(ql, k, v, DeviceChunks.build(zigzag_chunks(p.cu_seqlens_padded, 2, r), "cpu"), backend="sdpa")
        out.sum().backward()
        total[0][idx] += ql.grad
    total[1], total[2] = k.grad, v.grad
    for a, b in zip(total, grads):
        assert torch.allclose(a, b, atol=1e-12)


def test_backend_resolution():
    assert resolve_backend("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        resolve_backend("xformers", "cpu")
    with pytest.raises(ValueError, match="'varlen' is not available on cpu"):
        resolve_backend("varlen", "cpu")
    with pytest.raises(ValueError, match="'flash' is not available on cpu"):
        resolve_backend("flash", "cpu")
    assert set(BACKENDS) == {"sdpa", "flash", "varlen", "flash_attn", "te"}
    # fp32 inputs on CUDA (a bf16 run's fp32 probe step): the exact backend, as the flash kernels take bf16 / fp16 only
    assert resolve_backend("auto", "cuda", torch.float32) == "sdpa"
    assert resolve_lse_backend("auto", "cuda", torch.float32) == "sdpa"


@pytest.mark.parametrize("name", ["flash", "varlen", "flash_attn", "te"])
def test_optional_backends_match_sdpa_when_present(name):
    """CUDA backends against the fp32 ``sdpa`` reference on zig-zag chunks (bottom-right causal key
    prefixes, GQA): outputs within TE's bf16 tolerance, the gradients of q, k and v within 2% of the
    largest reference gradient (bf16 rounding stays ~0.5%; a wrong mask or formula is off by O(1))."""
    if not backend_available(name, "cuda"):
        pytest.skip(f"backend {name!r} needs CUDA and its package (flash-attn / transformer-engine are optional extras)")
    p = pack([300, 1000, 77], 8)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in qkv(p.total_tokens, H=8, Hkv=2, D=64))
    for r in range(4):
        idx = torch.as_tensor(zigzag_index_array(p.cu_seqlens_padded, 4, r), device="cuda")
        chunks = DeviceChunks.build(zigzag_chunks(p.cu_seqlens_padded, 4, r), "cuda")
        ins = [q[idx].detach().requires_grad_(True), k.detach().requires_grad_(True), v.detach().requires_grad_(True)]
        ref = [t.detach().float().requires_grad_(True) for t in ins]
        a = chunk_attention(*ins, chunks, backend=name)
        b = chunk_attention(*ref, chunks, backend="sdpa")
        torch.testing.assert_close(a.float(), b, atol=2.5e-2, rtol=2.5e-2)
        w = torch.randn(a.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(r))
        (a.float() * w).sum().backward()
        (b * w).sum().backward()
        for x, y, what in zip(ins, ref, "qkv"):  # relative to the largest gradient: dK/dV sum many bf16 terms
            err = ((x.grad.float() - y.grad).abs().max() / y.grad.abs().max()).item()
            assert err < 2e-2, f"rank {r}: d{what} max error {err:.2e} of the largest |d{what}|"


# ---------------------------------------------------------------- split attention and the ring plan

@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=5).filter(lambda x: sum(x) > 0),
       st.sampled_from([1, 2, 4]), st.integers(0, 2**16))
def test_split_attention_parts_merge_to_full_attention_with_gradients(lengths, lcp, seed):
    """Keys cut into two parts (one causal, one not) and merged by log-sum-exp give causal attention;
    each part's backward from the *merged* output and lse sums to autograd's gradients (fp64)."""
    from harness.parallel.ring import _merge
    from harness.runtime.attention import Segments, attention_backward_lse, attention_forward_lse

    g = torch.Generator().manual_seed(seed)
    lengths = [2 * L for L in lengths]  # every sequence: a first half (earlier keys) and a second half
    q, k, v, do = (torch.randn(sum(lengths), h, 8, generator=g, dtype=torch.float64) for h in (4, 4 // lcp, 4 // lcp, 4))
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + L)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = dense_reference(*ref, cu)
    (out_ref * do).sum().backward()
    half = [L // 2 for L in lengths]
    first = torch.tensor([a + i for a, h in zip(cu, half) for i in range(h)], dtype=torch.int64)
    second = first + torch.tensor([h for h in half for _ in range(h)], dtype=torch.int64)
    # part A: second halves against first halves, no mask; part B: second halves against themselves, causal
    sa, sb = Segments.build(half, half, "cpu"), Segments.build(half, half, "cpu")
    qs, ks, vs, kf, vf = q[second], k[second], v[second], k[first], v[first]
    oa, la = attention_forward_lse(qs, kf, vf, sa, causal=False, backend="sdpa")
    ob, lb = attention_forward_lse(qs, ks, vs, sb, causal=True, backend="sdpa")
    o, lse = ob.clone(), lb.clone()
    _merge(o, lse, oa, la)
    assert torch.allclose(o, out_ref[second], atol=1e-12)
    ga = attention_backward_lse(do[second], qs, kf, vf, o, lse, sa, causal=False, backend="sdpa")
    gb = attention_backward_lse(do[second], qs, ks, vs, o, lse, sb, causal=True, backend="sdpa")
    # the second halves' queries only: their dq, and their share of dk/dv (the first halves' own
    # causal part adds to dk/dv of the first halves and is left out of both sides)
    first_part = [t.clone().requires_grad_() for t in (q[first], k[first], v[first])]
    o1 = dense_reference(*first_part, [0] + list(torch.tensor(half).cumsum(0).tolist()))
    (o1 * do[first]).sum().backward()
    assert torch.allclose(ga[0] + gb[0], ref[0].grad[second], atol=1e-10)
    assert torch.allclose(gb[1], ref[1].grad[second], atol=1e-10)
    assert torch.allclose(ga[1] + first_part[1].grad, ref[1].grad[first], atol=1e-10)
    assert torch.allclose(ga[2] + first_part[2].grad, ref[2].grad[first], atol=1e-10)


@given(st.lists(st.integers(0, 12), min_size=1, max_size=6), st.sampled_from([2, 4, 8]), st.data())
def test_ring_plan_rows_are_the_zigzag_chunks_and_steps_cover_every_rank_once(chunks, cp, data):
    from harness.parallel.ring import RingPlan

    r = data.draw(st.integers(0, cp - 1))
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + 2 * cp * c)
    plan = RingPlan.build(cu, cp, r, "cpu")
    held = zigzag_index_array(cu, cp, r)  # pack positions of the local rows
    pos_first, pos_second = held[plan.first.numpy()], held[plan.second.numpy()]
    chunk_of = lambda p: [int(x - cu[i]) // c for x in p for i, c in enumerate(chunks) if cu[i] <= x < cu[i + 1]]  # noqa: E731
    assert chunk_of(pos_first) == [r] * sum(chunks) and chunk_of(pos_second) == [2 * cp - 1 - r] * sum(chunks)
    assert sorted(plan.first.tolist() + plan.second.tolist()) == list(range(len(held)))
    kinds = [plan.kind(t) for t in range(cp)]
    assert kinds[0] == "causal" and kinds.count("kv_first") == r and kinds.count("q_second") == cp - 1 - r


def test_ring_exchange_refuses_backends_without_a_log_sum_exp_and_unknown_exchanges():
    from harness.parallel.cp_attention import CPAttentionPlan
    from harness.runtime.attention import resolve_lse_backend

    with pytest.raises(ValueError, match="cannot run split attention.*exchange='gather'"):
        resolve_lse_backend("varlen", "cpu")
    assert resolve_lse_backend("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="unknown CP exchange 'p2p'; choose one of gather, ring, a2a, auto"):
        CPAttentionPlan.build([0, 8], 2, 0, "cpu", exchange="p2p")
    assert CPAttentionPlan.build([0, 8], 1, 0, "cpu", exchange="ring").ring is None  # no exchange at cp 1


def test_auto_exchange_picks_the_ring_only_for_long_blocks_on_cuda(monkeypatch):
    import harness.parallel.cp_attention as cpa

    big = cpa.RING_MIN_TOKENS_DEFAULT
    assert cpa.choose_exchange("auto", 10 * big, "cpu", 4) == "gather"  # the CPU reference ring is for checking
    assert cpa.choose_exchange("ring", 1, "cpu") == "ring" and cpa.choose_exchange("gather", 10 * big, "cpu") == "gather"
    monkeypatch.setattr(cpa, "backend_available", lambda name, device: name == "flash")  # as on a GPU node
    assert cpa.choose_exchange("auto", big, "cuda", 8) == "ring"  # sizes not measured: the default
    assert cpa.choose_exchange("auto", big - 1, "cuda", 8) == "gather"
    for cp in (2, 4):  # measured: the ring wins from 8K tokens per rank at cp 2 and 4
        assert cpa.choose_exchange("auto", 8192, "cuda", cp) == "ring"
        assert cpa.choose_exchange("auto", 8191, "cuda", cp) == "gather"
    plan = cpa.CPAttentionPlan.build([0, 4 * big], 2, 1, "cpu", exchange="auto")  # built where it runs: CPU
    assert plan.exchange == "gather" and plan.chunks is not None


def test_a2a_exchange_splits_heads_or_says_which_exchange_to_use():
    from harness.parallel.ulysses import HeadPlan, HeadSplitError, head_parallel_attention, kv_replicas

    assert kv_replicas(16, 16, 4) == 1 and kv_replicas(16, 8, 4) == 1
    assert kv_replicas(4, 2, 4) == 2 and kv_replicas(8, 1, 4) == 4 and kv_replicas(8, 2, 8) == 4
    with pytest.raises(HeadSplitError, match="heads=4 is not a multiple of cp_size=8; use exchange='gather'"):
        kv_replicas(4, 2, 8)
    assert kv_replicas(12, 6, 4) == 2 and kv_replicas(12, 6, 2) == 1  # 2 query heads a K/V head: 1 a copy
    plan = HeadPlan.build([0, 8, 24], 2, 0, "cpu")  # 24 tokens over 2 ranks: 12 local rows
    assert sorted(plan.perm.tolist()) == list(range(24)) and plan.inverse[plan.perm].tolist() == list(range(24))
    q = torch.zeros(12, 2, 4)
    with pytest.raises(ValueError, match="q/k/v hold 12/24/12 rows; .* a 24-token pack over cp=2 has 12"):
        head_parallel_attention(q, torch.zeros(24, 2, 4), q, plan, None)
    with pytest.raises(ValueError, match=r"CP block of 2 ranks got no group.*for_block\(block_start, 2\)"):
        head_parallel_attention(q, q, q, plan, None)


def test_ring_attention_refuses_a_wrong_slice_and_a_missing_group():
    from harness.parallel.ring import RingPlan, ring_attention

    plan = RingPlan.build([0, 8, 24], 2, 0, "cpu")  # chunks of 2 and 4 tokens: 12 local rows
    q = torch.zeros(12, 2, 4)
    with pytest.raises(ValueError, match="q/k/v hold 12/24/12 rows; this rank's zig-zag slice of the plan has 12"):
        ring_attention(q, torch.zeros(24, 2, 4), q, plan, None)
    with pytest.raises(ValueError, match=r"CP block of 2 ranks got no group.*for_block\(block_start, 2\)"):
        ring_attention(q, q, q, plan, None)
