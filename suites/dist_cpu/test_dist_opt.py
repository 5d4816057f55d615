"""``harness.parallel.dist_opt``: the distributed optimiser steps 1/N of the parameters on each rank and must update
them exactly as the replicated AdamW does.

Judged against the replicated optimiser on a separate copy of the model (torch's ``clip_grad_norm_`` and AdamW over
whole parameters after an all-reduce): bit for bit where no clipping applies (gradients whose sums are exact in fp32,
so the order of a reduce-scatter's additions does not matter), within fp32 rounding of the clipping coefficient
where it does; and in training runs (dcp, PP 2, EP) against the same runs with the replicated optimiser."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.jobs.launch import run_on_ranks
from harness.parallel.dist_opt import DistributedOptimizer, DistributedOptimizerError, ShardedBuffers, bucket_layout
from harness.parallel.grad_reduce import BucketedGradReducer, GradReduceError, _buckets
from harness.train.layouts import LayoutError
from harness.train.trainer import TrainConfig, train

pytestmark = pytest.mark.dist_cpu

SHAPES = [(7, 5), (5,), (13, 3), (1,), (11,), (4, 9), (3,)]
"""Odd sizes: no bucket's length is a multiple of 2 or 4 before padding."""


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=12), st.integers(1, 80), st.integers(1, 8))
def test_buckets_hold_whole_items_in_reverse_order_padded_to_the_group(sizes, bucket_elements, align):
    offsets, buckets, total = bucket_layout(sizes, bucket_elements, align)
    assert all((hi - lo) % align == 0 for lo, hi in buckets)
    assert total == (buckets[0][1] if buckets else 0) and (not buckets or buckets[-1][0] == 0)
    assert all(buckets[k + 1][1] == buckets[k][0] for k in range(len(buckets) - 1))  # tiling, launch order = reverse
    ends = sorted((o, o + n) for o, n in zip(offsets, sizes))
    assert all(b0 >= a1 for (_, a1), (b0, _) in zip(ends, ends[1:]))  # items do not overlap
    for o, n in zip(offsets, sizes):
        assert sum(lo <= o and o + n <= hi for lo, hi in buckets) >= 1
    # unpadded, the buckets are the ones the all-reduce derives from the same parameters
    offsets1, buckets1, _ = bucket_layout(sizes, bucket_elements, 1)
    spans = sorted((o, o + n, i) for i, (o, n) in enumerate(zip(offsets1, sizes)))
    if sizes and all(sizes):
        assert _buckets(spans, bucket_elements)[0] == buckets1


def test_bad_layouts_and_mismatched_groups_are_refused_with_the_fix():
    with pytest.raises(DistributedOptimizerError, match=r"align must be an int >= 1, got 0"):
        bucket_layout([3], 10, 0)
    with pytest.raises(DistributedOptimizerError, match=r"bucket_elements must be an int >= 1, got 0"):
        bucket_layout([3], 0, 2)
    model = _model()
    buffers = ShardedBuffers(model.parameters(), shards=2)
    with pytest.raises(DistributedOptimizerError, match=r"sharded 2 ways but the group has 1 ranks: build "
                                                        r"ShardedBuffers\(params, shards=1\)"):
        DistributedOptimizer(buffers, None, lambda ps: torch.optim.AdamW(ps))
    with pytest.raises(LayoutError, match=r"optimizer must be one of replicated, distributed, got 'zero1'"):
        TrainConfig(optimizer="zero1").validate(4)
    with pytest.raises(LayoutError, match=r"grad_bucket_elements must be an int >= 1, got 0"):
        TrainConfig(grad_bucket_elements=0).validate(4)


def test_a_reducer_that_does_not_fit_the_optimiser_is_refused_before_the_step():
    """A reduce-scattering reducer leaves only each rank's pieces summed: with the replicated AdamW the step would
    update from partial sums (silently wrong); an all-reducing one beside the distributed optimiser is refused too."""
    from harness.train.step import check_reducer

    model = _model()
    buffers = ShardedBuffers(model.parameters(), shards=1, bucket_elements=40)
    sharded = DistributedOptimizer(buffers, None, lambda ps: torch.optim.AdamW(ps))
    params = buffers.params[:buffers.count]
    scatter = BucketedGradReducer(params, buffers.flat[:buffers.end], buckets=buffers.buckets, scatter=True)
    plain = BucketedGradReducer(params, buffers.flat[:buffers.end])
    with pytest.raises(GradReduceError, match=r"reduce-scatters but the optimiser is replicated: build "
                                              r"BucketedGradReducer\(\.\.\., scatter=False\)"):
        check_reducer(torch.optim.AdamW(model.parameters()), scatter)
    with pytest.raises(GradReduceError, match=r"all-reduces but the optimiser is distributed: build "
                                              r"BucketedGradReducer\(\.\.\., scatter=True, buckets=buffers.buckets\)"):
        check_reducer(sharded, plain)
    check_reducer(sharded, scatter)
    check_reducer(torch.optim.AdamW(model.parameters()), plain)
    check_reducer(sharded, None)


def test_the_parameters_stay_the_models_own_and_the_masters_hold_their_values():
    """One rank (a group of 1): the masters tile every bucket; each holds the parameters' elements at their offsets
    (padding 0); the parameters are not rebound (their storage is their own)."""
    model = _model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    buffers = ShardedBuffers(model.parameters(), shards=1, bucket_elements=40)
    opt = DistributedOptimizer(buffers, None, lambda ps: torch.optim.AdamW(ps))
    assert [p.data_ptr() for p in model.parameters()] == ptrs and len(buffers.buckets) > 2
    whole = torch.zeros(buffers.end)
    for (lo, hi), m in zip(buffers.buckets, opt.masters):
        whole[lo:hi] = m
    for p, off in zip(buffers.params, buffers.offsets):
        assert torch.equal(whole[off:off + p.numel()].view_as(p), p.detach())
        assert p.grad.untyped_storage().data_ptr() == buffers.flat.untyped_storage().data_ptr()
    assert whole.count_nonzero() == sum(p.numel() for p in model.parameters())  # the padding holds zeros


def _model():
    torch.manual_seed(0)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s)) for s in SHAPES])


def _grads(rank: int, step: int, params) -> list[torch.Tensor]:
    """Rank-dependent gradients on a grid of 1/16: their sums are exact in fp32 in any order."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-64, 65, p.shape, generator=g).float() / 16 for p in params]


def _compare_world(rank: int, world: int, spec: dict) -> dict:
    """The distributed optimiser (overlapped reducer or not) and the replicated one, side by side, on one rank
    (``spec["device"]``: ``cuda`` runs on this rank's GPU with NCCL and fused AdamW)."""
    cuda = spec.get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    adamw = {"lr": 1e-2, "weight_decay": 0.1, **({"fused": True} if cuda else {})}
    group = dist.new_group(list(range(world)))
    mine, ref = _model().to(dev), _model().to(dev)
    buffers = ShardedBuffers(mine.parameters(), shards=world, bucket_elements=spec["bucket"])
    opt = DistributedOptimizer(buffers, group, lambda ps: torch.optim.AdamW(ps, **adamw))
    ref_opt = torch.optim.AdamW(ref.parameters(), **adamw)
    reducer = BucketedGradReducer(buffers.params[:buffers.count], buffers.flat[:buffers.end], group,
                                  buckets=buffers.buckets, scatter=True) if spec["overlap"] else None
    norms = []
    for step in range(3):
        gs = [g.to(dev) for g in _grads(rank, step, mine)]
        if reducer is not None:  # gradients arrive as a backward produces them: last parameters first
            reducer.arm()
            for p, g in reversed(list(zip(buffers.params, gs))):
                (p * g).sum().backward()
            reducer.finish()
            assert reducer.launched_in_backward == len(buffers.buckets)
        else:
            for p, g in zip(buffers.params, gs):
                p.grad.copy_(g)
            opt.reduce_scatter()
        norm = opt.grad_norm()
        opt.clip_(spec["clip"], norm)
        opt.step()
        buffers.zero_()
        for p, g in zip(ref.parameters(), gs):
            p.grad = g.clone()
            dist.all_reduce(p.grad)
        ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), spec["clip"])
        ref_opt.step()
        norms.append((float(norm), float(ref_norm)))
    return {"mine": [p.detach().cpu().clone() for p in mine.parameters()],
            "ref": [p.detach().cpu().clone() for p in ref.parameters()],
            "norms": norms, "state": opt.state_bytes(), "ref_state": sum(
                v.numel() * v.element_size() for s in ref_opt.state.values() for v in s.values() if torch.is_tensor(v))}


@pytest.mark.parametrize("world, overlap", [(2, False), (4, True)], ids=["2-ranks", "4-ranks-overlapped"])
def test_without_clipping_every_rank_holds_the_replicated_update_bit_for_bit(world, overlap, tmp_path):
    got = run_on_ranks(_compare_world, world_size=world, tmp_path=tmp_path, timeout_s=120,
                       args=({"bucket": 40, "overlap": overlap, "clip": 1e9},))
    for r in got:
        assert all(torch.equal(a, b) for a, b in zip(r["mine"], r["ref"]))
        assert all(abs(a - b) <= 1e-6 * b for a, b in r["norms"])
        assert r["state"] < r["ref_state"] / world * 1.6  # ~1/N of AdamW's state (plus the padding and step counts)
    assert all(torch.equal(a, b) for a, b in zip(got[0]["mine"], got[-1]["mine"]))  # the replicas agree


def test_with_clipping_the_update_is_the_replicated_one_within_fp32_rounding(tmp_path):
    got = run_on_ranks(_compare_world, world_size=4, tmp_path=tmp_path, timeout_s=120,
                       args=({"bucket": 25, "overlap": False, "clip": 1.0},))
    for r in got:
        assert all(a > 1.0 for a, _ in r["norms"])  # clipping applies at every step
        assert all(abs(a - b) <= 1e-6 * b for a, b in r["norms"])
        for a, b in zip(r["mine"], r["ref"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(got[0]["mine"], got[-1]["mine"]))


def _odd_bucket_world(rank: int, world: int, spec: dict) -> str:
    model = _model()
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    off = 0
    for p in model.parameters():
        p.grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    try:
        BucketedGradReducer(list(model.parameters()), flat, None, bucket_elements=10**9, scatter=True)
    except GradReduceError as e:
        return str(e)
    return "accepted"


def test_a_bucket_that_does_not_split_evenly_is_refused_with_the_fix(tmp_path):
    got = run_on_ranks(_odd_bucket_world, world_size=4, tmp_path=tmp_path, timeout_s=60, args=({},))  # 130 elements
    assert all("cannot be reduce-scattered over 4 ranks" in m and "ShardedBuffers" in m for m in got), got


def _both_optimizers(rank: int, world: int, cfg: dict) -> dict:
    """The same training run with each optimiser, one after the other in one world."""
    return {o: train(rank, world, {**cfg, "optimizer": o})["layouts"] for o in ("replicated", "distributed")}


@pytest.mark.parametrize("cfg", [
    {"model": "tiny-gpt", "layouts": ["dcp"]},
    {"model": "tiny-gpt", "layouts": ["dcp"], "pp": 2, "max_seqlen_per_rank": 512},
    {"model": "tiny-moe", "layouts": ["dcp"], "expert_parallel": True},
], ids=["dcp", "dcp-pp2", "dcp-ep"])
def test_training_with_the_distributed_optimiser_equals_the_replicated_one(cfg, tmp_path):
    """Two steps (the second trains from the first update) of each layout: the same losses (1e-6) and gradient norms
    (1e-6 relative) as the run whose every rank keeps the whole AdamW, with several buckets (a small bucket size)."""
    cfg = {**cfg, "steps": 2, "grad_bucket_elements": 20_000, "corpus": {"sequences_per_batch": 16}}
    got = run_on_ranks(_both_optimizers, world_size=4, tmp_path=tmp_path, args=(cfg,), timeout_s=300)[0]
    for a, b in zip(got["distributed"]["dcp"], got["replicated"]["dcp"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * b["grad_norm"], (a["step"], a["grad_norm"], b["grad_norm"])
