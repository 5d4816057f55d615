"""``harness.parallel.sequence_parallel``: a block stack whose token rows are split over the TP ranks computes what the
whole, unsplit stack computes.

Judged against the unsplit model in one process (the same seed's weights, autograd over whole matrices and every
row): a real gloo world of 2 and 4 TP ranks runs two dense blocks (``TinyLM.run_layers``) forward and backward,
rows scattered at the entry and gathered at the exit, and after the split norms' gradients are summed over TP
(``reduce_grads``) every whole gradient, the input's gradient and the output equal the unsplit stack's in fp64. Each
sequence-parallel seam replaced by its catalogue fault breaks it. Training runs are in
``suites/convergence/test_tensor_parallel_parity.py``; the padding that makes the rows split evenly in
``suites/runtime/test_microbatch_build.py``."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from harness.faults import sp_faults
from harness.jobs.launch import run_on_ranks
from harness.parallel import sequence_parallel as spm
from harness.parallel import tensor_parallel as tpm
from harness.parallel.groups import DynamicGroups, ParallelLayout
from harness.parallel.options import SequenceParallelError
from harness.runtime.model import MODELS, ModelConfig, TinyLM
from harness.train.config import TrainConfig
from harness.train.layouts import LayoutError
from suites.dist_cpu.test_tensor_parallel import _causal

pytestmark = pytest.mark.dist_cpu

ROWS = 24


def test_the_split_region_holds_the_blocks_norms_and_nothing_else():
    c = MODELS["tiny-gpt-mtp"]
    marked = sorted(n for n, _ in TinyLM(c).named_parameters() if spm.in_region(n))
    assert marked == sorted([f"blocks.{i}.norm{j}.weight" for i in range(c.layers) for j in (1, 2)] +
                            ["mtp.0.block.norm1.weight", "mtp.0.block.norm2.weight"])
    assert not any(spm.in_region(n) for n in ("norm.weight", "mtp.0.norm_h.weight", "mtp.0.norm_e.weight",
                                              "embed.weight", "head.weight", "mtp.0.combine.weight"))


@pytest.mark.parametrize("cfg, world, match", [
    ({"sequence_parallel": True}, 4, r"sequence parallelism .* tp=1: use tp >= 2"),
    ({"sequence_parallel": "yes", "tp": 2}, 4, r"sequence_parallel must be True or False, got 'yes'"),
])
def test_configurations_sequence_parallelism_cannot_run_are_refused_with_the_fix(cfg, world, match):
    with pytest.raises(LayoutError, match=match):
        TrainConfig(**cfg).validate(world)


def _stack_world(rank: int, world: int, fault: str | None = None, stages: bool = False, moe: bool = False) -> dict:
    """Every rank: the whole two-block stack (same seed) and its TP shard with sequence parallelism on the same rows;
    the output, the input's gradient and every whole gradient (split norms summed over TP) against the whole
    stack's. ``stages``: the split stack runs as two pipeline chunks of one block each, the first handing on its
    rank's rows (``split_out``) and the second taking them (``split_in``). ``moe``: the second block is an MoE block
    (experts split over TP, the router routing each rank's rows), its z-loss in the loss (weighted up so that its
    gradient counts) and compared too."""
    from harness.faults.catalogue import get

    torch.manual_seed(0)
    c = ModelConfig(layers=2, heads=4, kv_heads=4 if world == 4 else 2, ffn=128,
                    **({"experts": 4, "top_k": 2, "z_loss": 0.05} if moe else {}))
    ref = TinyLM(c).double()
    part = TinyLM(c).double()
    part.load_state_dict(ref.state_dict())
    groups = DynamicGroups(ParallelLayout(dp=1, cp=1, tp=world), rank)
    tp = tpm.TensorParallel(world, rank, groups.tp_group, sequence_parallel=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, c.hidden, generator=g, dtype=torch.float64)
    w = torch.randn(ROWS, c.hidden, generator=g, dtype=torch.float64)
    pos, real = torch.arange(ROWS), torch.ones(ROWS)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    real[-3:] = 0  # padding rows: outside the z-loss
    ya, za = ref.run_layers(xa, pos, real, _causal)
    ((ya * w).sum() + za).backward()
    with get(fault).applied() if fault else nullcontext():
        tpm.shard_model(part, tp)
        if stages:
            mid, z0 = part.run_layers(xb, pos, real, _causal, layers=[0], tp=tp, split_out=True)
            assert mid.shape[0] == ROWS // world  # a stage hands on this rank's share of the rows
            yb, z1 = part.run_layers(mid, pos, real, _causal, layers=[1], tp=tp, split_in=True)
            zb = z0 + z1
        else:
            yb, zb = part.run_layers(xb, pos, real, _causal, tp=tp)
        ((yb * w).sum() + zb).backward()
        spm.reduce_grads(list(part.parameters()), tp)
    whole = dict(ref.named_parameters())
    grads = {n: (tpm.whole(n, p.grad, c, tp) - whole[n].grad).abs().max().item()
             for n, p in part.named_parameters() if p.grad is not None}
    groups.destroy()
    return {"out": (ya - yb).abs().max().item(), "dx": (xa.grad - xb.grad).abs().max().item(), "grads": grads,
            "z": abs(float(za - zb)), "z_value": float(za)}


@pytest.mark.parametrize("world, stages, moe", [(2, False, False), (4, False, False), (2, True, False),
                                                (2, False, True), (4, False, True), (2, True, True)],
                         ids=["tp2", "tp4", "tp2-two-chunks", "moe-tp2", "moe-tp4", "moe-tp2-two-chunks"])
def test_a_sequence_parallel_stack_equals_the_whole_stack_forward_and_backward(world, stages, moe, tmp_path):
    """The MoE cases: the router's logits, choices, gate weights and z-loss come from each rank's rows, the experts
    run on every rank's rows, and the router's gradient - whole after the TP sum - equals the unsplit block's."""
    for r in run_on_ranks(_stack_world, world_size=world, tmp_path=tmp_path, args=(None, stages, moe),
                          timeout_s=60):
        assert r["out"] < 1e-12 and r["dx"] < 1e-12 and r["z"] < 1e-12, r
        assert len(r["grads"]) == (19 if moe else 12), sorted(r["grads"])  # MoE: + the router, 4 experts x 2
        assert all(v < 1e-12 for v in r["grads"].values()), r["grads"]  # NaN fails
        assert r["z_value"] > 0.1 if moe else r["z_value"] == 0, r  # the z-loss is there to be wrong


@pytest.mark.parametrize("fault", [f.name for f in (*sp_faults.SP_FAULTS, *sp_faults.SP_MOE_FAULTS)])
def test_every_sequence_parallel_fault_breaks_the_split_stack(fault, tmp_path):
    """The check above can fail: each catalogue fault of the sequence-parallel seams leaves some whole gradient (the
    norms', the router's, or every parameter's) or the z-loss off the unsplit stack's."""
    moe = fault in {f.name for f in sp_faults.SP_MOE_FAULTS}
    got = run_on_ranks(_stack_world, world_size=2, tmp_path=tmp_path, args=(fault, False, moe), timeout_s=60)
    assert all(not all(v <= 1e-6 for v in [r["dx"], r["z"], *r["grads"].values()]) for r in got), \
        [(r["z"], r["grads"]) for r in got]


def _uneven_world(rank: int, world: int) -> str:
    groups = DynamicGroups(ParallelLayout(dp=1, cp=1, tp=world), rank)
    tp = tpm.TensorParallel(world, rank, groups.tp_group, sequence_parallel=True)
    try:
        tp.scatter(torch.zeros(7, 4))
    except SequenceParallelError as e:
        return str(e)
    finally:
        groups.destroy()
    return "no error"


def test_rows_that_do_not_split_evenly_are_refused_naming_the_count_and_the_fix(tmp_path):
    for msg in run_on_ranks(_uneven_world, world_size=2, tmp_path=tmp_path, timeout_s=60):
        assert "7 token rows over tp=2 ranks: not a multiple of 2" in msg and "padding_divisor" in msg, msg
