"""GPU convergence (``pytest -m gpu suites/gpu``): bshd / thd / dcp in bf16 with NCCL on 2 and 4
GPUs; per-step |delta loss| <= 2e-3 and mean <= 5e-4 against bshd (``harness.apps.converge.TOLERANCES``;
for MoE over the first 20 steps, then the late-window band: see ``harness.apps.converge``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe", "tiny-gpt-mtp", "tiny-hybrid"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_layouts_agree_in_bf16(nproc, model, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs")
    from harness.apps import converge
    from harness.data.corpus import CorpusConfig
    from harness.train.trainer import TrainConfig

    # MoE: top-k routing turns last-bit bf16 differences into discrete flips; 128 sequences per batch
    # (~25K tokens) average them like a real batch would, 32 (~6K) do not
    corpus = CorpusConfig(sequences_per_batch=128 if model == "tiny-moe" else 32)
    cfg = TrainConfig(model=model, steps=30, device="cuda", dtype="bfloat16", max_seqlen_per_rank=1024 // nproc,
                      corpus=corpus)
    res = converge.run(cfg, world=nproc, golden="off", out_root=tmp_path, progress=lambda s: None)
    print({c["target"]: round(c["value"], 6) for c in res.checks})
    base = [r["loss"] for r in res.rows["bshd"]]
    for layout in ("thd", "dcp"):
        print(layout, [f"{abs(r['loss'] - b):.1e}" for r, b in zip(res.rows[layout], base)])
    assert res.verdict == "PASS", res.checks
    assert {c["target"].split(":")[0] for c in res.checks} >= {"thd vs bshd", "dcp vs bshd"}


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe", "tiny-gpt-mtp", "tiny-hybrid"])
@pytest.mark.parametrize("vpp", [1, 2])
def test_pipeline_of_two_stages_with_dynamic_cp_in_bf16(vpp, model, tmp_path):
    """PP 2 x dynamic CP 2 on 4 GPUs (NCCL point to point between the stages, CP groups inside each
    stage), with and without interleaving: the layouts agree within the GPU tolerances."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA GPUs (2 pipeline stages x 2 DP x CP ranks)")
    from harness.apps import converge
    from harness.data.corpus import CorpusConfig
    from harness.train.trainer import TrainConfig

    corpus = CorpusConfig(sequences_per_batch=128 if model == "tiny-moe" else 32)
    cfg = TrainConfig(model=model, steps=30, device="cuda", dtype="bfloat16", max_seqlen_per_rank=512, pp=2, vpp=vpp,
                      corpus=corpus)
    res = converge.run(cfg, world=4, golden="off", out_root=tmp_path, progress=lambda s: None)
    print({c["target"]: round(c["value"], 6) for c in res.checks})
    assert res.verdict == "PASS", res.checks
    assert all("timeline" in rs[0] for rs in res.rows.values())
