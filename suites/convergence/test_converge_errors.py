"""Bad input to the convergence runner: clear, typed errors before anything is launched; an
interrupted run leaves earlier reports and goldens intact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import golden
from harness.apps import converge
from harness.train.layouts import LayoutError
from harness.train.trainer import TrainConfig

pytestmark = pytest.mark.usefixtures("shared_zygote")  # CLI jobs fork their ranks from one zygote


@pytest.mark.parametrize("cfg, world, match", [
    (TrainConfig(layouts=("bshd", "ring")), 4, "unknown layout"),
    (TrainConfig(model="tiny-llama"), 4, "unknown model 'tiny-llama'"),
    (TrainConfig(cp_exchange="p2p"), 4, "cp_exchange must be one of gather, ring, a2a, auto or te:"),
    (TrainConfig(cp_exchange="te:ring"), 4, "unknown TransformerEngine CP communication type 'ring'"),
    (TrainConfig(), 3, "world size 3 is not a power of two"),
    (TrainConfig(), 2, r"needs a static CP group of 4 ranks .* world has 2"),
    (TrainConfig(corpus=__import__("harness.data.corpus", fromlist=["CorpusConfig"]).CorpusConfig(sequences_per_batch=31),
                 max_seqlen_per_rank=512), 4, "multiple of 2"),
    (TrainConfig(model="tiny-hybrid"), 8, r"SSM mixers' 4 heads cannot be split over a CP block of 8 ranks"),
    (TrainConfig(cp_exchange="a2a"), 8, r"heads=4 is not a multiple of cp_size=8; use exchange='gather'.*8-rank"),
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
    from harness.data.corpus import CorpusConfig

    if "corpus" in kw:
        kw["corpus"] = CorpusConfig(**kw["corpus"])
    with pytest.raises(ValueError, match=match):
        converge.run(TrainConfig(**kw), world=world, out_root=tmp_path, progress=lambda s: None)
    assert list(tmp_path.iterdir()) == []


def test_missing_golden_says_how_to_create_it(tmp_path, monkeypatch):
    from harness.data.corpus import CorpusConfig

    monkeypatch.setattr("harness.jobs.entry.launch", lambda *a, **k: pytest.fail("trained before checking the golden"))
    with pytest.raises(golden.GoldenError, match=r"missing; create it with: dcp-harness converge .*--steps 7 .*--update-golden"):
        converge.run(TrainConfig(steps=7, corpus=CorpusConfig(seed=5)), world=4, golden="require", out_root=tmp_path,
                     progress=lambda s: None)


def test_corrupted_golden_is_reported_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(golden, "GOLDEN_DIR", tmp_path / "golden")
    monkeypatch.setattr(golden.path_for, "__defaults__", ("any", tmp_path / "golden"))
    cfg = TrainConfig(steps=5)
    path = golden.path_for(converge.GOLDEN_SUITE, converge.case_id(cfg, 4), "cpu")
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 1, "data": [')
    with pytest.raises(golden.GoldenError, match="corrupted"):
        converge.run(cfg, world=4, out_root=str(tmp_path / "reports"), progress=lambda s: None)  # a str path too


def test_an_interrupted_run_leaves_earlier_reports_and_goldens_intact(tmp_path, monkeypatch):
    earlier = tmp_path / "converge-20260101-000000"
    earlier.mkdir()
    (earlier / "index.html").write_text("earlier report")
    gold = golden.path_for(converge.GOLDEN_SUITE, "converge__tiny_gpt__w4__fp32", "cpu")
    before = gold.read_bytes()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("harness.jobs.entry.launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        converge.run(TrainConfig(steps=50), world=4, golden="update", out_root=tmp_path, progress=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converge-20260101-000000"]
    assert (earlier / "index.html").read_text() == "earlier report" and gold.read_bytes() == before


def test_cli_bad_input_exits_2_without_traceback():
    r = subprocess.run([sys.executable, "-m", "harness", "converge", "--layouts", "bshd,ring"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown layout" in r.stderr and "Traceback" not in r.stderr


def test_golden_file_records_its_config_and_rule():
    doc = json.loads(golden.path_for(converge.GOLDEN_SUITE, "converge__tiny_gpt__w4__fp32", "cpu").read_text())
    assert doc["config"]["world"] == 4 and doc["config"]["steps"] == 100 and doc["config"]["model"] == "tiny-gpt"
    assert doc["rule"] == {"kind": "approx", "atol": 1e-5, "rtol": 0.0}
    assert set(doc["data"]) == {"bshd", "thd", "dcp"} and len(doc["data"]["bshd"]) == 100
    assert doc["data"]["bshd"][0] > doc["data"]["bshd"][-1]  # the loss falls


def _golden_case(tmp_path, monkeypatch, edit, steps=5):
    """A copy of the committed tiny-GPT golden, edited, in a private golden folder; ``converge.run`` on it with
    the launcher replaced by one that fails the test (nothing may train)."""
    src = golden.path_for(converge.GOLDEN_SUITE, "converge__tiny_gpt__w4__fp32", "cpu")
    monkeypatch.setattr(golden.path_for, "__defaults__", ("any", tmp_path / "golden"))
    dst = golden.path_for(converge.GOLDEN_SUITE, "converge__tiny_gpt__w4__fp32", "cpu")
    dst.parent.mkdir(parents=True)
    doc = json.loads(src.read_text())
    edit(doc)
    dst.write_text(json.dumps(doc))
    monkeypatch.setattr("harness.jobs.entry.launch", lambda *a, **k: pytest.fail("trained before checking the golden"))
    return lambda: converge.run(TrainConfig(steps=steps), world=4, out_root=tmp_path / "reports", golden="require",
                                progress=lambda s: None)


@pytest.mark.parametrize("edit, steps, match", [
    (lambda d: d["rule"].update(atol=1e9), 5, r"looser than the harness's tolerance .*atol 1e\+09 > 1e-05.* only tighten"),
    (lambda d: d["rule"].update(rtol=0.5), 5, r"looser .*rtol 0.5 > 0"),
    (lambda d: d["rule"].update(atol="1e-5"), 5, r"rule atol '1e-5' must be a finite number >= 0"),
    (lambda d: d["rule"].update(atol=float("nan")), 5, r"rule atol nan must be a finite number >= 0"),
    (lambda d: d["rule"].update(kind="close"), 5, r"rule kind 'close' must be one of \['exact', 'approx'\]"),
    (lambda d: d["data"]["bshd"].__setitem__(1, "2.5"), 5, r"step 2: bshd is '2.5': not a finite number"),
    (lambda d: d["data"]["bshd"].__setitem__(1, float("nan")), 5, r"step 2: bshd is nan: not a finite number"),
    (lambda d: d["data"].pop("bshd"), 5, r"has no series 'bshd'"),
    (lambda d: d["data"].update(bshd=d["data"]["bshd"][:3]), 5, r"holds 3 steps of bshd, this run trains 5.*--steps 3"),
])
def test_a_golden_that_is_loose_malformed_or_short_is_refused_before_training(edit, steps, match, tmp_path,
                                                                                monkeypatch):
    run = _golden_case(tmp_path, monkeypatch, edit, steps)
    with pytest.raises(golden.GoldenError, match=match):
        run()
    assert not (tmp_path / "reports").exists() or not any((tmp_path / "reports").glob("converge-*"))


def test_a_tighter_golden_rule_and_a_longer_golden_are_accepted(tmp_path, monkeypatch):
    """A golden may tighten the tolerance, and a golden of N steps serves a shorter run (its prefix)."""
    doc = json.loads(golden.path_for(converge.GOLDEN_SUITE, "converge__tiny_gpt__w4__fp32", "cpu").read_text())
    _golden_case(tmp_path, monkeypatch, lambda d: d["rule"].update(atol=1e-6))
    g = converge.load_golden(TrainConfig(steps=5), 4, "cpu")
    assert g["tol"] == {"max": 1e-6, "mean": 1e-6} and g["steps"] == 100
    assert g["series"]["bshd"] == doc["data"]["bshd"][:5]
