"""Expert parallelism on real gloo worlds (``harness.parallel.expert_parallel``).

The MoE layer with its experts sharded over 2 and 4 ranks, tokens dispatched and combined by
all-to-all, equals the single-process layer on all the tokens: outputs, input gradients, the router's
gradient summed over the ranks and each expert's gradient on its owner. Cases include idle ranks (no
tokens at all), ranks that receive no token for their experts (routes forced by replay) and a world with
no token anywhere; every rank joins every all-to-all either way. In fp64 everything agrees to fp64
rounding: the router computes in at least fp32 and keeps an fp64 model's fp64 (rounded to fp32, a
one-token rank's router logits took another BLAS kernel than the full batch's and differed by an fp32
ulp). In fp32, summation order alone separates them. Then router replay with EP, and the training step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from harness.jobs.launch import run_on_ranks
from harness.parallel.expert_parallel import (
    ExpertDispatch,
    ExpertParallelError,
    ExpertShard,
    LockstepError,
    check_divisible,
    check_lockstep,
    is_expert_param,
    shard_experts,
)
from harness.runtime.layers import MoE, local_experts
from harness.runtime.model_config import ModelConfig
from harness.runtime.replay import ReplayStore, Routing
from harness.train.replay import replay_check

pytestmark = pytest.mark.dist_cpu

CFG = ModelConfig(experts=4, top_k=2, hidden=16, ffn=24, seed=5)
CASES = {  # name -> (tokens per rank, forced experts for every token or None = the router's top-k)
    2: {"uneven": ([5, 7], None), "idle-rank": ([0, 9], None), "no-tokens-for-rank-1": ([6, 4], [0, 1]),
        "all-idle": ([0, 0], None)},
    4: {"uneven-idle": ([3, 0, 8, 1], None), "one-owner": ([4, 4, 4, 4], [3, 2]), "one-holder": ([0, 0, 0, 5], None)},
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:
        return 0.0
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _routing(forced, n: int):
    if forced is None:
        return None
    store = ReplayStore()
    store.put(1, 0, 0, torch.tensor(forced, dtype=torch.int64).repeat(n, 1))
    return Routing("replay", store)


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _case(rank: int, world: int, counts: list[int], forced, dtype, group) -> dict:
    """One case: the single-process layer on every token vs the sharded layer on this rank's share."""
    moe = MoE(CFG, layer=1).to(dtype)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.3)
    N = sum(counts)
    x, do = (torch.randn(N, CFG.hidden, generator=gen, dtype=dtype) for _ in range(2))
    real = torch.ones(N, dtype=dtype)
    ref, xr = copy.deepcopy(moe), x.clone().requires_grad_()
    out_ref, z = ref(xr, real, _routing(forced, N))
    ((out_ref * do).sum() + z).backward()
    a = sum(counts[:rank])
    b = a + counts[rank]
    shard = ExpertShard(CFG.experts, world, rank)
    ep, xl = shard_experts(copy.deepcopy(moe), shard), x[a:b].clone().requires_grad_()
    out, zl = ep(xl, real[a:b], _routing(forced, b - a), experts=ExpertDispatch(shard, group))
    ((out * do[a:b]).sum() + zl).backward()
    router = _grad(ep.router.weight).clone()
    dist.all_reduce(router, group=group)
    refp = dict(ref.named_parameters())
    experts = {n: _rel(_grad(p), _grad(refp[n])) for n, p in ep.named_parameters() if is_expert_param(n)}
    return {"out": _rel(out, out_ref[a:b]), "dx": _rel(xl.grad if xl.grad is not None else torch.zeros_like(xl),
                                                       xr.grad[a:b] if N else xr[a:b]),
            "router": _rel(router, _grad(ref.router.weight)), "experts": experts,
            "owned": sorted({int(n.split(".")[1]) for n in experts})}


def _layer_world(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))
    out = {f"{name}/{str(dt).split('.')[-1]}": _case(rank, world, counts, forced, dt, group)
           for name, (counts, forced) in CASES[world].items() for dt in (torch.float64, torch.float32)}
    try:  # one rank with a micro-batch fewer: every rank refuses before any all-to-all
        check_lockstep(3 if rank == 0 else 4, group, torch.device("cpu"))
        out["lockstep"] = None
    except LockstepError as e:
        out["lockstep"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_and_combine_equal_the_single_process_layer(world, tmp_path):
    results = run_on_ranks(_layer_world, world_size=world, tmp_path=tmp_path, timeout_s=120)
    for rank, r in enumerate(results):
        assert "3 to 4 micro-batches" in r["lockstep"], r["lockstep"]
        for case, c in r.items():
            if case == "lockstep":
                continue
            exact = case.endswith("float64")
            assert c["owned"] == list(range(rank * 4 // world, (rank + 1) * 4 // world)), c  # experts: its shard
            assert c["out"] <= (1e-14 if exact else 1e-6), (rank, case, c)
            assert max(c["experts"].values()) <= (1e-14 if exact else 1e-5), (rank, case, c)
            assert c["dx"] <= (1e-14 if exact else 1e-6), (rank, case, c)
            assert c["router"] <= (1e-14 if exact else 1e-5), (rank, case, c)


@pytest.mark.parametrize("pp, cp", [pytest.param(1, 2, marks=pytest.mark.slow), (2, 2)], ids=["cp2", "pp2_cp2"])
def test_router_replay_holds_with_expert_parallelism(pp, cp, tmp_path):
    results = run_on_ranks(replay_check, world_size=pp * cp, tmp_path=tmp_path,
                           args=({"pp": pp, "cp": cp, "ep": True},), timeout_s=300)
    for r in results:
        assert r["ep"] and r["tokens_checked"] > 0 and r["replay_mismatches"] == 0, r  # the recorded experts
        assert r["free_mismatches"] > 0, r                                            # without replay: others
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
        assert r["grad_rel"] and all(v <= 1e-5 for v in r["grad_rel"].values()), r["grad_rel"]  # NaN fails
    experts = [n for r in results for n in r["grad_rel"] if is_expert_param(n)]
    assert experts and len(experts) == len(set(experts))  # each expert's gradient checked once, on its owner


def _train_pair(rank: int, world: int) -> dict:
    from harness.train.trainer import train

    cfg = {"model": "tiny-moe", "steps": 2, "layouts": ["dcp"], "probes": True, "max_seqlen_per_rank": 256,
           "corpus": {"sequences_per_batch": 8}}
    return {ep: train(rank, world, {**cfg, "expert_parallel": ep}) for ep in (False, True)}


@pytest.mark.slow
def test_a_training_step_with_expert_parallelism_equals_the_one_without(tmp_path):
    """2 ranks, tiny MoE, 2 steps of dcp: loss, gradient norm and every step-1 gradient (each expert's on
    its owner) agree with the run that keeps every expert on every rank; replicated parameters stay
    identical across the ranks."""
    import numpy as np

    got = run_on_ranks(_train_pair, world_size=2, tmp_path=tmp_path, timeout_s=300)
    base, ep = got[0][False]["layouts"]["dcp"], got[0][True]["layouts"]["dcp"]
    for a, b in zip(base, ep):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]
    for r in got:
        want, have = r[False]["probes"]["dcp"]["grads"], r[True]["probes"]["dcp"]["grads"]
        assert {n for n in want if is_expert_param(n)} > {n for n in have if is_expert_param(n)}
        for n, g in have.items():
            w = np.asarray(want[n])
            assert np.linalg.norm(np.asarray(g) - w) <= 1e-5 * np.linalg.norm(w), n
    assert got[0][True]["probes"]["dcp"]["digests"] == got[1][True]["probes"]["dcp"]["digests"]


def test_bad_expert_parallel_inputs_are_typed_errors():
    with pytest.raises(ExpertParallelError, match=r"6 experts over the 4-rank DP x CP domain: 6 is not a multiple of 4"):
        check_divisible(6, 4)
    with pytest.raises(ExpertParallelError, match="EP rank 2 is outside the domain of 2 ranks"):
        ExpertShard(4, 2, 2)
    moe = MoE(CFG, layer=1)
    shard_experts(moe, ExpertShard(4, 2, 1))
    assert sorted(moe.experts) == ["2", "3"]
    with pytest.raises(ValueError, match="holds 2 of its 4 experts"):
        local_experts(moe, torch.zeros(3, CFG.hidden), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    with pytest.raises(ExpertParallelError, match="already sharded"):
        shard_experts(moe, ExpertShard(4, 2, 1))


@pytest.mark.slow
def test_expert_parallel_seams_are_live_and_a_passthrough_changes_nothing(tmp_path):
    """The dispatch's seams (``harness.faults``) wrapped by call counters in the fault catalogue's
    ``train-ep`` run: each is called, and every step-1 gradient and replicated parameter equals the run's
    without pass-throughs, bit for bit."""
    import numpy as np

    from harness.faults import SEAMS
    from harness.faults import scenarios as sc

    seams = [s for s in SEAMS if s.startswith("harness.parallel.expert_parallel")]
    cfg = {**sc.TRAIN_CONFIGS["train-ep"], "layouts": ["dcp"]}
    got = run_on_ranks(sc.passthrough_world, world_size=sc.WORLD, tmp_path=tmp_path,
                       args=({"kind": "train", "cfg": cfg, "seams": seams, "clean": True},), timeout_s=300)
    assert len(seams) == 2 and all(sum(r["counts"].get(s, 0) for r in got) > 0 for s in seams)
    for r in got:
        a, b = r["out"]["probes"]["dcp"], r["clean"]["probes"]["dcp"]
        assert a["digests"] == b["digests"] and a["grads"].keys() == b["grads"].keys()
        assert all(np.array_equal(a["grads"][n], b["grads"][n]) for n in a["grads"])
