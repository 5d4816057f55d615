"""The SSM mixer under CP on a real gloo world of 4 ranks: every rank of a block runs the mixer on its
zig-zag slice through ``CPChannelExchange``; outputs, input gradients and the parameter gradients
summed over the block equal the single-process mixer on the whole pack. One world runs every block
layout (1, 2, 4 and mixed) in fp32 and fp64; the tests below judge its results."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness.jobs.launch import run_on_ranks
from harness.parallel.groups import DynamicGroups, ParallelLayout
from harness.parallel.ssm_cp import CPChannelExchange, ExchangeError
from harness.plan.thd import pack, padding_divisor, zigzag_index_array
from harness.runtime.ssm import SequenceLayout, SSMConfig, SSMMixer, SSMShardError

pytestmark = pytest.mark.dist_cpu

WORLD = 4
LAYOUTS = [[1, 1, 1, 1], [2, 2], [4], [2, 1, 1], [1, 1, 2]]


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _block(sizes: list[int], position: int) -> tuple[int, int]:
    starts = np.concatenate([[0], np.cumsum(sizes)])
    k = int(np.searchsorted(starts, position, side="right") - 1)
    return int(starts[k]), int(sizes[k])


def _grads(mixer) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in mixer.named_parameters()}


def _run(mixer, x_TE, do_TE, seqs, exchange=None):
    """Forward and backward of ``sum(out * do)``: (out, dx, parameter gradients)."""
    mixer.zero_grad(set_to_none=True)
    x = x_TE.clone().requires_grad_()
    out = mixer(x, seqs, exchange)
    (out * do_TE).sum().backward()
    return out.detach(), x.grad, _grads(mixer)


def _results(out, dx, grads) -> dict[str, torch.Tensor]:
    return {"out": out, "dx": dx, **{f"d.{n}": g for n, g in grads.items()}}


def _one_dtype(dtype, cfg, x, do, seqs, idx, exchange, group) -> tuple[dict, dict]:
    """(single-process results restricted to the slice, CP results with parameter gradients summed)."""
    mixer = SSMMixer(cfg).to(dtype)
    out_ref, dx_ref, g_ref = _run(mixer, x.to(dtype), do.to(dtype), seqs)
    out, dx, g = _run(mixer, x[idx].to(dtype), do[idx].to(dtype), seqs, exchange)
    for t in g.values():
        dist.all_reduce(t, group=group)  # parameter gradients summed over the block
    return _results(out_ref[idx], dx_ref[idx], g_ref), _results(out, dx, g)


def _compare(m: int, sizes: list[int], rank: int, groups: DynamicGroups) -> dict:
    """One block's pack in fp64 and fp32. fp32's tolerance per quantity is max(1e-6, twice the
    single-process fp32 error against fp64): a bias gradient sums signed terms over the pack, and
    its cancellation leaves single-process fp32 itself up to ~5e-6 off (conv_bc_bias)."""
    start, size = _block(sizes, rank)
    group = groups.for_block(start, size)
    rng = np.random.default_rng([m, start])  # the same pack on every rank of the block
    p = pack(rng.integers(1, 90, size=int(rng.integers(1, 4))).tolist(), padding_divisor(cp_size=size))
    cfg = SSMConfig(hidden=16, heads=8, head_dim=4, state=6, conv=4, chunk=16, seed=m)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    x, do = (torch.randn(p.total_tokens, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    seqs = SequenceLayout(p.cu_seqlens_padded)
    idx = torch.as_tensor(zigzag_index_array(p.cu_seqlens_padded, size, rank - start))
    exchange = CPChannelExchange(group, size, rank - start, p.cu_seqlens_padded, "cpu")
    ref64, cp64 = _one_dtype(torch.float64, cfg, x, do, seqs, idx, exchange, group)
    ref32, cp32 = _one_dtype(torch.float32, cfg, x, do, seqs, idx, exchange, group)
    return {"mb": m, "layout": sizes, "size": size, "tokens": p.total_tokens, "sequences": len(p.cu_seqlens) - 1,
            "rel64": {k: _rel(cp64[k], ref64[k]) for k in ref64},
            "rel32": {k: _rel(cp32[k], ref32[k]) for k in ref32},
            "tol32": {k: max(1e-6, 2 * _rel(ref32[k], ref64[k])) for k in ref32},
            "bitwise32": sorted(k for k in ref32 if torch.equal(cp32[k], ref32[k]))}


def _refusals(rank: int, groups: DynamicGroups) -> dict:
    """Heads that do not divide over cp, and a group of the wrong size, are refused on every rank."""
    out = {}
    ex = CPChannelExchange(groups.group(4), 4, rank, [0, 8, 16], "cpu")
    try:
        SSMMixer(SSMConfig(hidden=8, heads=6, head_dim=2, state=2))(torch.randn(4, 8), SequenceLayout((0, 8, 16)), ex)
    except SSMShardError as e:
        out["shard"] = str(e)
    try:
        CPChannelExchange(groups.group(4), 2, rank % 2, [0, 8], "cpu")
    except ExchangeError as e:
        out["group"] = str(e)
    return out


def ssm_world(rank: int, world: int) -> dict:
    groups = DynamicGroups(ParallelLayout(dp=world, cp=1, tp=1), rank)
    torch.manual_seed(0)
    cases = [_compare(m, sizes, rank, groups) for m, sizes in enumerate(LAYOUTS)]
    return {"rank": rank, "cases": cases, "refusals": _refusals(rank, groups)}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_on_ranks(ssm_world, world_size=WORLD, tmp_path=tmp_path_factory.mktemp("ssm"), timeout_s=120)


def test_cp_mixer_equals_the_single_process_mixer(world):
    """Outputs, input gradients and every parameter's gradient (summed over the block): fp64 within
    1e-12; fp32 within 1e-6 or, where single-process fp32 itself is further from fp64, twice that."""
    for r in world:
        for c in r["cases"]:
            assert max(c["rel64"].values()) <= 1e-12, (r["rank"], c["layout"], c["rel64"])
            bad = {k: (v, c["tol32"][k]) for k, v in c["rel32"].items() if v > c["tol32"][k]}
            assert not bad, (r["rank"], c["layout"], bad)


def test_every_block_size_and_mixed_layouts_ran_with_several_sequences(world):
    cases = [c for r in world for c in r["cases"]]
    assert {c["size"] for c in cases} == {1, 2, 4}
    assert {tuple(c["layout"]) for c in cases} == {tuple(s) for s in LAYOUTS}
    assert len(cases[0]["rel32"]) == 2 + sum(1 for _ in SSMMixer(SSMConfig()).parameters())
    assert max(c["sequences"] for c in cases) > 1


def test_heads_that_do_not_divide_over_cp_and_a_wrong_group_are_refused_on_every_rank(world):
    for r in world:
        assert "H=6" in r["refusals"]["shard"] and "cp=4" in r["refusals"]["shard"]
        assert "DynamicGroups.for_block" in r["refusals"]["group"]


def test_one_rank_exchange_is_the_identity_and_checks_shapes():
    ex = CPChannelExchange(None, 1, 0, [0, 5, 8], "cpu")
    u = torch.randn(8, 6)
    assert ex.to_channels(u) is u and ex.to_tokens(u) is u and ex.replicate(u) is u
    assert (ex.shards, ex.shard) == (1, 0)
    with pytest.raises(ExchangeError, match=r"expects \[8, channels\], got \[5, 6\]"):
        ex.to_channels(torch.randn(5, 6))
