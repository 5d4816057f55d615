"""The overlapped gradient all-reduce on NCCL (``pytest -m gpu suites/gpu``): on CUDA the hooks run
on autograd's device thread and the bucket all-reduces on NCCL's stream while the backward goes on;
the result must still equal one all-reduce of the accumulated gradients, bit for bit (2 ranks). The distributed
optimiser's in-place reduce-scatter and all-gather of padded buckets on NCCL, with fused AdamW on its pieces: the
replicated fused AdamW's update, bit for bit (2 and 4 ranks)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def test_overlapped_reduction_equals_one_all_reduce_on_nccl(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from harness.jobs.launch import run_on_ranks
    from suites.dist_cpu.test_grad_reduce import reduce_world

    ranks = run_on_ranks(reduce_world, world_size=2, tmp_path=tmp_path, args=("cuda",), backend="nccl", timeout_s=120)
    for r in ranks:
        assert r["equal"] == [True, True]
        assert r["orders"] == [list(range(r["buckets"]))] * 2 and r["launched"] == [r["buckets"]] * 2


@pytest.mark.parametrize("world, overlap", [(2, False), (4, True)], ids=["2-ranks", "4-ranks-overlapped"])
def test_the_distributed_optimiser_equals_the_replicated_one_on_nccl(world, overlap, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    from harness.jobs.launch import run_on_ranks
    from suites.dist_cpu.test_dist_opt import _compare_world

    got = run_on_ranks(_compare_world, world_size=world, tmp_path=tmp_path, backend="nccl", timeout_s=120,
                       args=({"bucket": 40, "overlap": overlap, "clip": 1e9, "device": "cuda"},))
    for r in got:
        assert all(torch.equal(a, b) for a, b in zip(r["mine"], r["ref"]))
        assert all(abs(a - b) <= 1e-6 * b for a, b in r["norms"])
    assert all(torch.equal(a, b) for a, b in zip(got[0]["mine"], got[-1]["mine"]))
