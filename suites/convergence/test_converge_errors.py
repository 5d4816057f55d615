"""Bad input to the convergence runner: clear, typed errors before anything is launched; an
interrupted run leaves earlier reports and goldens intact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import converge, golden
from harness.dist.layouts import LayoutError
from harness.dist.train import TrainConfig


@pytest.mark.parametrize("cfg, world, match", [
    (TrainConfig(layouts=("bshd", "ring")), 4, "unknown layout"),
    (TrainConfig(model="tiny-llama"), 4, "unknown model 'tiny-llama'"),
    (TrainConfig(cp_exchange="p2p"), 4, "cp_exchange must be one of gather, ring, auto, got 'p2p'"),
    (TrainConfig(), 3, "world size 3 is not a power of two"),
    (TrainConfig(), 2, r"needs a static CP group of 4 ranks .* world has 2"),
    (TrainConfig(corpus=__import__("harness.corpus", fromlist=["CorpusConfig"]).CorpusConfig(sequences_per_batch=31),
                 max_seqlen_per_rank=512), 4, "multiple of 2"),
    (TrainConfig(model="tiny-hybrid"), 8, r"SSM mixers' 4 heads cannot be split over a CP block of 8 ranks"),
])
def test_layouts_the_world_cannot_run(cfg, world, match, tmp_path):
    with pytest.raises(LayoutError, match=match):
        converge.run(cfg, world=world, out_root=tmp_path, progress=lambda s: None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw, world, match", [
    ({"pp": 3}, 4, r"pp=3 must be a positive divisor of the world \(4 ranks\)"),
    ({"vpp": 2}, 4, "virtual_pipeline_model_parallel_size=2 needs pipeline parallelism"),
    ({"pp": 2, "vpp": 3}, 4, "2 layers cannot be split over pp=2 x vpp=3 = 6 model chunks"),
    ({"pp": 2, "pipeline": "zero-bubble"}, 4, "pipeline schedule must be afab or 1f1b"),
    ({"pp": 2, "schedule_delivery": "gossip"}, 4, "schedule delivery must be one of broadcast, compute"),
    ({"pp": 2, "max_seqlen_per_rank": 512, "vpp": 2, "model": "tiny-moe",
      "corpus": {"sequences_per_batch": 31}}, 4, r"step 1, layout bshd: .* not a multiple of the interleaved"),
    ({"pp": 2, "vpp": 2, "max_seqlen_per_rank": 4096, "layouts": ("dcp",), "scheduler": "dp-balanced",
      "corpus": {"sequences_per_batch": 1, "lengths": "const:value=100"}}, 4, r"step 1, layout dcp: .*vpp_group=2"),
])
def test_pipelines_the_world_cannot_run(kw, world, match, tmp_path):
    """Bad pipeline options fail before any process starts, naming the value and the fix: a stage count
    that does not divide the world, VPP without PP, layers the split cannot hold, unknown kinds, and
    VPP groups a step's batch cannot satisfy (every step is planned first)."""
    from harness.corpus import CorpusConfig

    if "corpus" in kw:
        kw["corpus"] = CorpusConfig(**kw["corpus"])
    with pytest.raises(ValueError, match=match):
        converge.run(TrainConfig(**kw), world=world, out_root=tmp_path, progress=lambda s: None)
    assert list(tmp_path.iterdir()) == []


def test_missing_golden_says_how_to_create_it(tmp_path):
    with pytest.raises(golden.GoldenError, match=r"missing; create it with: dcp-harness converge .*--steps 7 .*--update-golden"):
        converge.run(TrainConfig(steps=7), world=4, golden="require", out_root=tmp_path, progress=lambda s: None)


def test_corrupted_golden_is_reported_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(golden, "GOLDEN_DIR", tmp_path / "golden")
    monkeypatch.setattr(golden.path_for, "__defaults__", ("any", tmp_path / "golden"))
    cfg = TrainConfig(steps=5)
    path = golden.path_for(converge.GOLDEN_SUITE, converge.case_id(cfg, 4), "cpu")
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 1, "data": [')
    with pytest.raises(golden.GoldenError, match="corrupted"):
        converge.run(cfg, world=4, out_root=tmp_path / "reports", progress=lambda s: None)


def test_an_interrupted_run_leaves_earlier_reports_and_goldens_intact(tmp_path, monkeypatch):
    earlier = tmp_path / "converge-20260101-000000"
    earlier.mkdir()
    (earlier / "index.html").write_text("earlier report")
    gold = golden.path_for(converge.GOLDEN_SUITE, "converge__tiny_gpt__w4__s50__fp32", "cpu")
    before = gold.read_bytes()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("harness.dist.entry.launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        converge.run(TrainConfig(steps=50), world=4, golden="update", out_root=tmp_path, progress=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converge-20260101-000000"]
    assert (earlier / "index.html").read_text() == "earlier report" and gold.read_bytes() == before


def test_cli_bad_input_exits_2_without_traceback():
    r = subprocess.run([sys.executable, "-m", "harness", "converge", "--layouts", "bshd,ring"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown layout" in r.stderr and "Traceback" not in r.stderr


def test_golden_file_records_its_config_and_rule():
    doc = json.loads(golden.path_for(converge.GOLDEN_SUITE, "converge__tiny_gpt__w4__s50__fp32", "cpu").read_text())
    assert doc["config"]["world"] == 4 and doc["config"]["steps"] == 50 and doc["config"]["model"] == "tiny-gpt"
    assert doc["rule"] == {"kind": "approx", "atol": 1e-5, "rtol": 0.0}
    assert set(doc["data"]) == {"bshd", "thd", "dcp"} and len(doc["data"]["bshd"]) == 50
    assert doc["data"]["bshd"][0] > doc["data"]["bshd"][-1]  # the loss falls
