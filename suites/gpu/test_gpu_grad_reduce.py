"""The overlapped gradient all-reduce on NCCL (``pytest -m gpu suites/gpu``): on CUDA the hooks run
on autograd's device thread and the bucket all-reduces on NCCL's stream while the backward goes on;
the result must still equal one all-reduce of the accumulated gradients, bit for bit (2 ranks)."""

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
