"""Route tensors: alignment to left-padded sequences, THD / CP / TP slicing, the non-packed order,
and the replay configuration rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.plan.errors import PlanInputError
from harness.plan.replay import (
    ReplayConfigError,
    align_routes,
    narrow_dtype,
    packed_routes,
    sp_rows,
    thd_routes,
    unpacked_routes,
    validate_replay_config,
)
from harness.plan.thd import pack, zigzag_gather

A6_MASK = np.array([[1] * 5 + [0] * 4, [1] * 9, [1] * 3 + [0] * 6])


def a6_ids():
    ids = np.zeros((3, 9, 1, 1), int)
    ids[0, :5, 0, 0], ids[1, :, 0, 0], ids[2, :3, 0, 0] = range(10, 15), range(20, 29), range(30, 33)
    return ids


_ = 0
A6 = {  # spec A.6: a0..a4 = 10..14, b0..b8 = 20..28, c0..c2 = 30..32, _ = padding
    (1, 2): {(0, 0): [10, 11, _, _, 20, 21, 22, _, _, _, 30, _], (1, 0): [12, 13, 14, _, 23, 24, 25, 26, 27, 28, 31, 32]},
    (2, 2): {(0, 0): [10, 11, _, _, 20, 21, 22, 23], (0, 1): [_, _, _, _, 30, 31, _, _],
             (1, 0): [12, 13, 14, _, 24, 25, 26, 27], (1, 1): [28, _, _, _, 32, _, _, _]},
    (2, 1): {(0, 0): [10, 11, 12, 13, 14, _, 20, 21, 22, 23], (0, 1): [24, 25, 26, 27, 28, _, 30, 31, 32, _]},
}


@pytest.mark.parametrize("tp, cp", list(A6))
def test_spec_a6_worked_example(tp, cp):
    for (c, t), want in A6[(tp, cp)].items():
        assert packed_routes(a6_ids(), A6_MASK, tp=tp, cp=cp, cp_rank=c, tp_rank=t)[:, 0, 0].tolist() == want


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=5), tp=st.sampled_from([1, 2, 4]),
       cp=st.sampled_from([1, 2, 4]))
def test_slicing_matches_the_token_packing_and_gathers_back(lengths, tp, cp):
    """Oracle: routes encoding (sample, position) land where the packed tokens land, for every rank,
    and the ranks' slices gather back into the packed order."""
    S = max(lengths)
    mask = np.array([[1] * n + [0] * (S - n) for n in lengths])
    ids = np.zeros((len(lengths), S, 1, 1), int)
    for i, n in enumerate(lengths):
        ids[i, :n, 0, 0] = 1000 * (i + 1) + np.arange(n)
    align = tp * cp * 2 if cp > 1 else tp
    p = pack(lengths, align)
    packed_tokens = np.zeros(p.total_tokens, int)
    for i, n in enumerate(lengths):
        packed_tokens[p.cu_seqlens_padded[i]:p.cu_seqlens_padded[i] + n] = 1000 * (i + 1) + np.arange(n)
    per_cp = []
    for c in range(cp):
        parts = [packed_routes(ids, mask, tp=tp, cp=cp, cp_rank=c, tp_rank=t)[:, 0, 0] for t in range(tp)]
        assert all(len(x) == p.total_tokens // (cp * tp) for x in parts)  # invariant 1: rows = router tokens
        per_cp.append(np.concatenate(parts))
    assert zigzag_gather(per_cp, p.cu_seqlens_padded, cp).tolist() == packed_tokens.tolist()


def test_sp_rows_are_each_tp_ranks_consecutive_block_and_uneven_rows_are_refused():
    rows = np.arange(12)[:, None, None]
    assert [sp_rows(rows, 3, t)[:, 0, 0].tolist() for t in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(PlanInputError, match=r"10 packed rows do not split over tp=4 ranks: pad every sequence"):
        sp_rows(np.zeros((10, 1, 1)), 4, 0)
    with pytest.raises(PlanInputError, match=r"tp_rank=2 outside tp=2"):
        sp_rows(rows, 2, 2)


def test_align_routes_captured_prefix_and_dtype():
    r = align_routes([[[[3, 1]]] * 2, None, [[[7, 300]]]], prompt_lens=[2, 1, 1], response_lens=[2, 1, 0])
    assert r.shape == (3, 4, 1, 2) and r.dtype == np.int16
    assert r[0, :, 0].tolist() == [[3, 1], [3, 1], [0, 1], [0, 1]]  # missing trailing rows: distinct experts
    assert r[1, :, 0].tolist() == [[0, 1]] * 4 and r[2, 3, 0].tolist() == [7, 300]
    assert r[2, :3, 0].tolist() == [[0, 1]] * 3  # left padding
    assert align_routes(None, [1], [1]) is None and align_routes([None], [1], [1]) is None
    assert narrow_dtype(np.array([200])).dtype == np.uint8 and narrow_dtype(np.array([40000])).dtype == np.int32
    with pytest.raises(PlanInputError, match="sample 0 has 5 route rows for 4 tokens"):
        align_routes([np.zeros((5, 1, 1))], [2], [2])
    with pytest.raises(PlanInputError, match="disagree"):
        align_routes([np.zeros((1, 2, 1)), np.zeros((1, 3, 1))], [1, 1], [0, 0])


def test_unpacked_routes_follow_the_routers_sequence_major_order():
    """Megatron's router sees [s, b] tokens: a0 b0 c0 a1 b1 c1 ... (upstream flattened batch-major)."""
    got = unpacked_routes(a6_ids(), A6_MASK, tp=1)[:, 0, 0].tolist()
    assert got[:6] == [10, 20, 30, 11, 21, 31]
    tp0 = unpacked_routes(a6_ids(), A6_MASK, tp=2, tp_rank=0)[:, 0, 0].tolist()
    assert tp0[:6] == [10, 20, 30, 11, 21, 31] and len(tp0) == 3 * 5


def test_thd_routes_rejects_rows_longer_than_the_padded_sequence():
    with pytest.raises(PlanInputError, match="padded length is 4"):
        thd_routes([np.zeros((5, 1, 1), int)], [0, 4])


VALID = dict(enable_replay=True, return_routes=True, cp_size=2, sample_packing=True)


@pytest.mark.parametrize("kw, match", [
    (dict(VALID, return_routes=False), "needs the rollout's routes"),
    (dict(VALID, enable_replay=False), "collected and ignored"),
    (dict(VALID, sample_packing=False), r"context parallel \(cp_size=2\) needs sample packing"),
    (dict(VALID, step_wise=True), "step-wise trajectories do not support returned routes"),
    (dict(VALID, vpp_size=2), "refused with virtual_pipeline_model_parallel_size=2"),
    (dict(VALID, transformer_config_kwargs={"virtual_pipeline_model_parallel_size": 4}), "=4"),
    (dict(VALID, transformer_config_kwargs={"moe_router_fusion": True}), "bypasses router replay"),
    (dict(VALID, transformer_config_kwargs={"moe_enable_routing_replay": False}), "silently disable replay"),
    (dict(VALID, enable_replay=False, return_routes=False, transformer_config_kwargs={"moe_enable_routing_replay": True}),
     "skip the replay checks"),
])
def test_invalid_configurations(kw, match):
    with pytest.raises(ReplayConfigError, match=match):
        validate_replay_config(**kw)


def test_valid_configurations_return_the_effective_flag():
    assert validate_replay_config(**VALID) is True
    assert validate_replay_config(**VALID, vpp_size=1) is True  # VPP 1 is no VPP (upstream's check refused it)
    assert validate_replay_config(**dict(VALID, transformer_config_kwargs={"moe_enable_routing_replay": True})) is True
    assert validate_replay_config(enable_replay=False, return_routes=False, cp_size=1, sample_packing=False) is False


@given(st.data())
def test_every_row_without_a_captured_route_holds_k_distinct_experts(data):
    """Left padding, uncaptured suffixes and THD padding replay K distinct experts (0 .. K-1), never one
    expert K times; captured rows are untouched; the same holds after CP and TP slicing."""
    K = data.draw(st.integers(1, 4), label="top_k")
    B = data.draw(st.integers(1, 4), label="samples")
    prompts = data.draw(st.lists(st.integers(1, 6), min_size=B, max_size=B))
    responses = data.draw(st.lists(st.integers(0, 6), min_size=B, max_size=B))
    captured = [data.draw(st.integers(0, p + r)) for p, r in zip(prompts, responses)]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    routes = [np.stack([rng.permutation(8)[:K] for _ in range(n)])[:, None, :] if n else None for n in captured]
    aligned = align_routes(routes, prompts, responses)
    if aligned is None:
        return
    width = max(p + r for p, r in zip(prompts, responses))
    for i, (p, r, n) in enumerate(zip(prompts, responses, captured)):
        left = width - p - r
        rows = aligned[i, :, 0]
        assert all(len(set(row)) == K for row in rows.tolist())
        if n:
            assert rows[left:left + n].tolist() == routes[i][:, 0].tolist()
        assert rows[:left].tolist() == [list(range(K))] * left
        assert rows[left + n:].tolist() == [list(range(K))] * (width - left - n)
    mask = np.zeros((B, width), int)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        mask[i, width - p - r:] = 1
    for cp, tp in ((1, 1), (2, 1), (2, 2)):
        for c in range(cp):
            for t in range(tp):
                got = packed_routes(aligned, mask, tp=tp, cp=cp, cp_rank=c, tp_rank=t)
                assert all(len(set(row)) == K for row in got[:, 0].tolist())
