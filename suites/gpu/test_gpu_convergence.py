"""GPU convergence (``pytest -m gpu suites/gpu``): bshd / thd / dcp in bf16 with NCCL on 2 and 4
GPUs; per-step |delta loss| <= 2e-3 and mean <= 5e-4 against bshd (``harness.converge.TOLERANCES``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_layouts_agree_in_bf16(nproc, model, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs")
    from harness import converge
    from harness.dist.train import TrainConfig

    cfg = TrainConfig(model=model, steps=30, device="cuda", dtype="bfloat16", max_seqlen_per_rank=1024 // nproc)
    res = converge.run(cfg, world=nproc, golden="off", out_root=tmp_path, progress=print)
    print({c["target"]: round(c["value"], 6) for c in res.checks})
    assert res.verdict == "PASS", res.checks
    assert {c["target"].split(":")[0] for c in res.checks} >= {"thd vs bshd", "dcp vs bshd"}
