"""Expert tensor parallelism (``harness.runtime.layers.tp_experts``): an MoE block whose experts each keep a TP shard
of their FFN computes what the whole block computes.

Judged against the unsplit MoE block in one process (the same seed's weights, top-k routing and autograd over whole
matrices): a real gloo world of 2 TP ranks runs the block forward and backward in fp64, and the output, the z-loss,
the input's gradient and every whole gradient - the router's included, which must be the same whole gradient on
every TP rank - equal the unsplit block's. The catalogue fault of the seam (the gate applied to the partial sums)
breaks it. Sequence parallelism's MoE blocks are in ``suites/dist_cpu/test_sequence_parallel.py``, training runs in ``suites/convergence/test_tensor_parallel_parity.py``."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from harness.jobs.launch import run_on_ranks
from harness.parallel import tensor_parallel as tpm
from harness.runtime.model import ModelConfig
from suites.dist_cpu.test_tensor_parallel import _causal, split_pair

pytestmark = pytest.mark.dist_cpu

ROWS = 20


def _moe_world(rank: int, world: int, fault: str | None = None) -> dict:
    from harness.faults.catalogue import get

    c = ModelConfig(experts=4, top_k=2)
    ref, part, tp, groups = split_pair(c, rank, world, moe=True, layer=1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, c.hidden, generator=g, dtype=torch.float64)
    w = torch.randn(ROWS, c.hidden, generator=g, dtype=torch.float64)
    pos, real = torch.arange(ROWS), torch.ones(ROWS, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, za = ref(xa, pos, real, _causal)
    ((ya * w).sum() + za).backward()
    with get(fault).applied() if fault else nullcontext():
        yb, zb = part(xb, pos, real, _causal, tp=tp)
        ((yb * w).sum() + zb).backward()
    whole = dict(ref.named_parameters())
    grads = {n: (tpm.whole(n, p.grad, c, tp) - whole[n].grad).abs().max().item() for n, p in part.named_parameters()}
    groups.destroy()
    return {"out": (ya - yb).abs().max().item(), "z": abs(float(za - zb)), "dx": (xa.grad - xb.grad).abs().max().item(),
            "grads": grads, "split": sorted(n for n, p in part.named_parameters() if tpm.is_sharded(p))}


def test_a_block_with_split_experts_equals_the_whole_moe_block(tmp_path):
    for r in run_on_ranks(_moe_world, world_size=2, tmp_path=tmp_path, timeout_s=60):
        assert r["out"] < 1e-12 and r["z"] < 1e-12 and r["dx"] < 1e-12, r
        assert "mlp.router.weight" in r["grads"] and all(v < 1e-12 for v in r["grads"].values()), r["grads"]
        assert "mlp.router.weight" not in r["split"] and "mlp.experts.3.down.weight" in r["split"], r["split"]


def test_the_gate_applied_to_partial_sums_breaks_the_router_gradient(tmp_path):
    """The check above can fail: the catalogue's fault leaves the forward alone and each rank's router gradient a
    partial sum."""
    for r in run_on_ranks(_moe_world, world_size=2, tmp_path=tmp_path, args=("etp-gate-on-partial-expert-outputs",),
                          timeout_s=60):
        assert r["out"] < 1e-12, r  # the same forward
        assert r["grads"]["mlp.router.weight"] > 1e-6, r["grads"]
