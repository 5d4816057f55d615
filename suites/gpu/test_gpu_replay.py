"""GPU router replay (``pytest -m gpu suites/gpu``): PP 2 x CP 2 on 4 GPUs, NCCL, bf16 autocast."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def test_replay_pp2_cp2_bf16(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA GPUs")
    from harness.jobs.entry import launch

    res = launch("replay", 4, tmp_path / "replay.json", {"pp": 2, "cp": 2, "dtype": "bfloat16", "sequences": 16,
                                                          "lengths": "uniform:min=64,max=2048"})
    for r in res["ranks"]:
        print(r["rank"], r["replay_mismatches"], r["tokens_checked"], r["free_mismatches"], r["loss"], r["ref_loss"],
              max(r["grad_rel"].values()))
        assert r["tokens_checked"] > 0 and r["replay_mismatches"] == 0
        assert r["free_mismatches"] > 0
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-2 * abs(r["ref_loss"])  # bf16, different partitions
        assert all(v <= 5e-2 for v in r["grad_rel"].values()), r["grad_rel"]  # NaN fails
