"""A reference trained once serves every case of a job whose reference is the same run (``converge.run``'s
``references``): the main job's one-stage and pipeline cases, a nightly model's cases on one stage and on two.
The reference runs on one rank without CP or a pipeline, so those cases' references are one run; a reused one must
judge exactly as a freshly trained one, and a planted fault or another configuration must never reuse it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.apps import converge, main_job, reference
from harness.apps.nightly.cases import NIGHTLY_MODELS, choose
from harness.train.trainer import TrainConfig

pytestmark = pytest.mark.usefixtures("shared_zygote")  # the jobs fork their ranks from one zygote


def _cfg(spec: dict, **over) -> tuple[TrainConfig, int]:
    c = dict(spec)
    world = c.pop("world")
    return replace(TrainConfig(**c), **over), world


def _key(cfg: TrainConfig, plant: str | None = None) -> str:
    around = {"around": ["harness.faults.catalogue:planted", plant]} if plant else {}
    return reference.key({**reference.config(cfg).to_dict(), **around})


def test_which_cases_share_a_reference():
    one, _ = _cfg(main_job.DEFAULT_CONVERGENCE)
    piped, _ = _cfg(main_job.DEFAULT_PIPELINE)
    hybrid, _ = _cfg(main_job.DEFAULT_HYBRID)
    assert _key(one) == _key(piped)  # 4 ranks of CP on one stage, 2 stages of 2: one reference
    assert len({_key(one), _key(hybrid), _key(one, "rope-positions-per-rank"), _key(replace(one, steps=49)),
                _key(replace(one, dtype="bfloat16"))}) == 5
    for gpus, device in ((0, "cpu"), (4, "cuda")):  # the nightly: each model's two cases share one, no two models do
        cases = [c for c in choose(models=list(NIGHTLY_MODELS), steps=100, device=device, world=None,
                                   gpus=gpus).cases if c.role != "stack"]
        keys = {_key(c.cfg) for c in cases}
        assert len(cases) == 2 * len(NIGHTLY_MODELS) and len(keys) == len(NIGHTLY_MODELS), device


def test_a_pipeline_case_reuses_its_one_stage_cases_reference_and_is_judged_as_by_a_fresh_one(tmp_path, monkeypatch):
    from harness.jobs import entry

    launched = []
    real = entry.launch

    def counting(name, n, *args, **kw):
        launched.append(n)
        return real(name, n, *args, **kw)

    monkeypatch.setattr(entry, "launch", counting)
    one, world_one = _cfg(main_job.DEFAULT_CONVERGENCE, steps=2, layouts=("dcp",))
    piped, world_piped = _cfg(main_job.DEFAULT_PIPELINE, steps=2, layouts=("dcp",))
    said = []
    references: dict = {}
    kw = {"golden": "off", "report": False}
    converge.run(one, world=world_one, out_root=tmp_path, run_dir=tmp_path / "one", references=references,
                 progress=lambda s: None, **kw)
    shared = converge.run(piped, world=world_piped, out_root=tmp_path, run_dir=tmp_path / "piped",
                          references=references, progress=said.append, **kw)
    assert launched == [4, 1, 4]  # the one-stage case, its reference, the pipeline case: no second reference
    assert any("the same reference as case converge__tiny_gpt__w4" in s for s in said), said
    assert (tmp_path / "piped" / "reference.jsonl").read_bytes() == (tmp_path / "one" / "reference.jsonl").read_bytes()
    fresh = converge.run(piped, world=world_piped, out_root=tmp_path, run_dir=tmp_path / "fresh",
                         progress=lambda s: None, **kw)
    assert launched[3:] == [4, 1]  # without the dict it trains its own
    judged = {c["target"]: c["value"] for c in shared.checks if c.get("reference")}
    assert judged == {c["target"]: c["value"] for c in fresh.checks if c.get("reference")} and judged
    assert shared.verdict == fresh.verdict == "PASS"
