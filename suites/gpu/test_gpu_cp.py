"""GPU suite (run on GPU nodes: ``pytest -m gpu suites/gpu``): the dist_cpu checks under torchrun with
NCCL, in bf16 with TransformerEngine's tolerances (atol = rtol = 2.5e-2), on packs up to 128K tokens,
with the flash backends (the ATen op, the default; ``varlen_attn``), on 2 and 4 GPUs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

CONFIGS = {
    "pack128k": {"dtype": "bfloat16", "backend": "flash", "pack_tokens": 131072, "max_seqs": 8, "heads": 16,
                 "kv_heads": 4, "head_dim": 128, "reroute_sequences": 64, "max_seqlen_per_rank": 4096},
    "many_short": {"dtype": "bfloat16", "backend": "varlen", "max_seq": 4000, "max_seqs": 16, "heads": 8,
                   "kv_heads": 8, "head_dim": 64, "seed": 7},
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("nproc", [2, 4])
def test_cp_attention_on_gpus(nproc, config, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs")
    from harness.jobs.entry import launch

    res = launch("checks", nproc, tmp_path / "checks.json", CONFIGS[config])
    seen = set()
    for r in res["ranks"]:
        assert all(g["ok"] for g in r["groups"].values()), r["groups"]
        rr = r["reroute"]
        assert rr["gids"] == rr["expected_gids"] and rr["content_ok"] and rr["sizes_ok"] and rr["slices_ok"]
        for a in r["attention"]:
            seen.add((a["size"], a["exchange"]))
            assert a["tol_ratio"] <= 1.0, (r["rank"], a)
            assert a["group_rank_sum"] == a["expected_rank_sum"]
    assert seen == {(s, x) for s in (1, 2, 4) if s <= nproc for x in ("gather", "ring", "a2a")}
    print({config: [(a["size"], a["exchange"], a["backend"], a["tokens"], round(a["tol_ratio"], 3),
                     {k: f"{v:.1e}" for k, v in a["rel"].items()})
                    for a in res["ranks"][0]["attention"]]})
