"""``dcp-harness nightly``: which cases run where, the proof that each exercises dynamic CP, the history
(concurrent appends, truncated lines, newer formats), the page's flags, the producer's revision, bad
input, and (slow) real runs: a dcp run that never formed a CP group > 1 is NOT EXERCISED, never PASS."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli, golden
from harness.apps import converge
from harness.apps.nightly import cases as nc
from harness.apps.nightly import history
from harness.data.corpus import CorpusConfig
from harness.io import OutputPathError
from harness.report import nightly_report
from harness.train.layouts import LayoutError
from harness.train.trainer import TrainConfig

pytestmark = pytest.mark.usefixtures("shared_zygote")  # CLI jobs fork their ranks from one zygote

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------- the cases


def _plan(**kw):
    args = {"models": ("tiny-gpt",), "steps": 100, "device": "auto", "world": None, "gpus": 0} | kw
    return nc.choose(**args)


def test_the_cases_follow_the_machine_and_say_so():
    cpu = _plan()
    assert [(c.world, c.cfg.pp, c.cfg.device, c.cfg.dtype, c.role) for c in cpu.cases] == \
        [(4, 1, "cpu", "float32", nc.DISTRIBUTED), (4, 2, "cpu", "float32", nc.DISTRIBUTED)]
    assert "4 CPU ranks (gloo, fp32) because this machine has 0 GPUs" in cpu.line and "GPU" not in cpu.line.split(";")[1]
    one = _plan(gpus=1)  # one GPU: distributed on CPU ranks, numerics (no dcp) on the GPU
    assert [(c.world, c.cfg.device, c.cfg.layouts) for c in one.cases][-1] == (1, "cuda", ("bshd", "thd"))
    numerics = one.cases[-1].cfg  # the configuration the GPU suites calibrated the bf16 tolerances on
    assert (numerics.steps, numerics.max_seqlen_per_rank, numerics.corpus) == (nc.NUMERICS_STEPS, 1024, CorpusConfig())
    assert "bf16, 30 steps" in one.line
    assert all(c.cfg.device == "cpu" for c in one.cases if c.role == nc.DISTRIBUTED)
    assert "because this machine has 1 GPU;" in one.line and "single-GPU numerics" in one.line
    assert [(c.world, c.cfg.device, c.cfg.dtype) for c in _plan(gpus=3).cases if c.role == nc.DISTRIBUTED] == \
        [(2, "cuda", "bfloat16")]
    assert {c.world for c in _plan(gpus=8).cases} == {4}
    gpus = _plan(gpus=4).line  # 100 bf16 steps: strict over the first 30, then the late-window band (converge's rule)
    assert "4 GPUs (NCCL, bf16; per step over the first 30, then the last-10-step mean within 1%)" in gpus, gpus
    assert "4 GPUs (NCCL, bf16)" in _plan(gpus=4, steps=30).line


def test_on_gpus_megatron_cores_case_runs_or_the_line_says_why_not(monkeypatch):
    """On >= 2 GPUs the plan holds megatron-core's hybrid CP (verify megatron-core, its workarounds named) when its
    preflight passes, and otherwise names why in the one line; on CPU ranks it is not mentioned."""
    why = "verify megatron-core needs megatron-core 0.19, which needs Python >= 3.12"
    monkeypatch.setattr(nc, "_stack_unavailable", lambda world: why)
    gpus = _plan(gpus=4)
    assert nc.STACK not in {c.role for c in gpus.cases} and f"megatron-core's hybrid CP (skipped: {why}" in gpus.line
    assert "megatron-core" not in _plan().line
    monkeypatch.setattr(nc, "_stack_unavailable", lambda world: None)
    ran = [c for c in _plan(gpus=4).cases if c.role == nc.STACK]
    assert [(c.world, c.cfg.device, c.cfg.dtype, c.cfg.steps) for c in ran] == [(4, "cuda", "bfloat16", nc.STACK_STEPS)]
    assert ran[0].case_id.startswith("verify__megatron-core__workarounds-all__"), ran[0].case_id


@pytest.mark.parametrize("kw, message", [
    ({"world": 1, "device": "cpu"}, "never forms a CP group > 1, so its verdict could only be NOT EXERCISED"),
    ({"world": 3}, "nightly --world 3"),
    ({"device": "cuda", "gpus": 1}, "needs >= 2 GPUs for dynamic CP, this machine has 1"),
    ({"models": ("tiny-gpt", "nope")}, "unknown model(s) 'nope'"),
])
def test_bad_case_choices_are_refused(kw, message):
    with pytest.raises(LayoutError) as e:
        _plan(**kw)
    assert message in str(e.value)


def test_only_keeps_the_cases_whose_id_contains_a_part_and_says_so():
    plan = _plan(models=("tiny-gpt", "tiny-moe"), device="cpu")
    assert len(plan.cases) == 4
    pp2 = nc.only(plan, ("w4_pp2",))
    assert [c.case_id.split("__")[1:3] for c in pp2.cases] == [["tiny_gpt", "w4_pp2"], ["tiny_moe", "w4_pp2"]]
    assert pp2.line.endswith("; --only w4_pp2: 2 of 4 cases") and pp2.line.startswith(plan.line)
    one = nc.only(plan, ("tiny_moe__w4__", "tiny_gpt__w4_pp2"))
    assert [c.case_id for c in one.cases] == [plan.cases[1].case_id, plan.cases[2].case_id]
    assert nc.only(plan, ()) is plan
    with pytest.raises(LayoutError, match="nightly --only pp3: no case of this run has that in its id"):
        nc.only(plan, ("w4_pp2", "pp3"))


def test_the_nightly_configuration_mixes_cp_sizes_in_every_step():
    """Every step of the nightly cases forms CP groups of 1 and of the whole domain (planned as the
    ranks plan); the pre-nightly configuration (32 sequences a batch) does not, and is refused."""
    for case in _plan(steps=100).cases:
        nc.check_mixing(case)
    old = nc.NightlyCase(TrainConfig(model="tiny-gpt", steps=2, max_seqlen_per_rank=256), 4, nc.DISTRIBUTED)
    with pytest.raises(LayoutError, match=r"step 1's dcp schedule forms CP groups of \[1, 2\] only, not both 1 and 4"):
        nc.check_mixing(old)


def test_the_mixing_proof_plans_as_the_ranks_do_pipeline_included(monkeypatch):
    """tiny-hybrid on 2 stages of 4 GPUs: planned for the pipeline (as the ranks plan it), step 84 runs every
    sequence at CP 2; planned as one stage would be, every step mixes. Holding every step to the promise names step
    84; the promise itself (90% of the steps) holds. The exercise line after a run takes the same share."""
    from harness.apps import nightly

    (case,) = [c for c in _plan(models=("tiny-hybrid",), device="cuda", world=4, gpus=4).cases if c.cfg.pp == 2]
    nc.check_mixing(case)
    monkeypatch.setattr(nc, "MIX_FRACTION", 1.0)
    with pytest.raises(LayoutError, match=r"step 84's dcp schedule forms CP groups of \[2\] only, not both 1 and 2 "
                                          r"\(the whole domain\), and so do 0 more of its 100 steps: at least 100"):
        nc.check_mixing(case)
    monkeypatch.undo()
    ran = type("Ran", (), {"config": {"dcp_exercise": {"largest": 2, "steps": 100, "steps_mixed": 99}}})()
    (line,) = nightly._mixing_checks(ran, case)
    assert line["pass"] and line["exercise"] and "at least 90" in line["target"], line
    ran.config["dcp_exercise"]["steps_mixed"] = 89
    assert not nightly._mixing_checks(ran, case)[0]["pass"]


def test_bf16_loss_bands_are_scaled_for_models_with_ssm_mixers_only():
    """tiny-hybrid's bf16 loss bands are twice the table's (its layouts' rounding, measured on 4 GPUs); tiny GPT's
    and every fp32 band are the table's, and the step-1 gradient and token-loss bounds are never scaled."""
    from harness.stack.checks import BF16_MIXER_SCALE, TOLERANCES, tolerances

    assert converge.loss_tolerance(TrainConfig(model="tiny-hybrid", dtype="bfloat16")) == {"max": 4e-3, "mean": 1e-3}
    assert converge.loss_tolerance(TrainConfig(model="tiny-gpt", dtype="bfloat16")) == {"max": 2e-3, "mean": 5e-4}
    assert converge.loss_tolerance(TrainConfig(model="tiny-hybrid")) == {"max": 1e-5, "mean": 1e-5}
    hybrid = tolerances("bfloat16", "tiny-hybrid")
    assert BF16_MIXER_SCALE == 2.0 and hybrid["step1_gradients"] == TOLERANCES["bfloat16"]["step1_gradients"]
    assert hybrid["token_loss"] == TOLERANCES["bfloat16"]["token_loss"] and tolerances("bfloat16") == TOLERANCES["bfloat16"]


@pytest.mark.slow
def test_every_model_and_machine_kind_mixes_cp_sizes_in_every_step():
    for gpus in (0, 2, 4):
        for case in _plan(models=nc.NIGHTLY_MODELS, gpus=gpus).cases:
            nc.check_mixing(case)


def test_the_gpu_moe_cases_run_bshd_in_micro_batches_of_several_sequences():
    """On GPUs the MoE cases' 128-sequence batches run bshd as 32 padded micro-batches of 4 (one stage and two),
    not 128 of one; every other case keeps one sequence per bshd micro-batch."""
    from harness.data.corpus import batch_lengths
    from harness.train.layouts import plan as plan_layout

    gpu = _plan(models=nc.NIGHTLY_MODELS, device="cuda", gpus=4).cases
    moe = [c for c in gpu if c.cfg.model == "tiny-moe"]
    assert sorted(c.cfg.pp for c in moe) == [1, 2]
    for case in moe:
        lengths = batch_lengths(case.cfg.corpus, 0)
        sched, padding, longest = plan_layout("bshd", lengths, case.cfg.layout_config(case.world))
        assert (padding, sched.num_microbatches) == ("fixed", nc.MOE_GPU_BATCH // nc.MOE_GPU_MICRO_BATCH)
        assert {len(b.gids) for mb in sched.layout for b in mb} == {nc.MOE_GPU_MICRO_BATCH}
    others = [c for c in gpu + _plan(models=nc.NIGHTLY_MODELS).cases if c.cfg.model != "tiny-moe"]
    assert others and {c.cfg.micro_batch_size for c in others} == {1}


# ----------------------------------------------------------------------------- the history


def _append_many(root: str, tag: int, n: int) -> None:
    for i in range(n):
        history.append(Path(root), {"format": history.FORMAT, "case_id": f"c{tag}", "i": i, "pad": "x" * 3000})


def test_two_jobs_appending_to_one_history_interleave_whole_lines(tmp_path):
    ctx = mp.get_context("fork")  # the appends only: no torch in the children
    jobs = [ctx.Process(target=_append_many, args=(str(tmp_path), t, 150)) for t in (1, 2)]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join(60)
    assert [j.exitcode for j in jobs] == [0, 0]
    warnings = []
    lines = history.read(tmp_path, warn=warnings.append)
    assert not warnings and len(lines) == 300
    for tag in (1, 2):
        assert [e["i"] for e in lines if e["case_id"] == f"c{tag}"] == list(range(150))


def test_a_truncated_line_is_skipped_with_a_warning_and_a_newer_format_is_refused(tmp_path):
    good = {"format": 2, "case_id": "a", "date": "2026-01-01T00:00:00"}
    (tmp_path / history.NAME).write_text(json.dumps(good) + "\n" + json.dumps(good)[:20] + "\n")
    warnings = []
    assert history.read(tmp_path, warn=warnings.append) == [good]
    assert warnings == [f"nightly: skipping unreadable line 2 of {tmp_path / history.NAME}"]
    history.check_root(tmp_path)
    with (tmp_path / history.NAME).open("a") as f:
        f.write(json.dumps({**good, "format": history.FORMAT + 1}) + "\n")
    with pytest.raises(history.HistoryError, match=f"history format {history.FORMAT + 1}, written by a newer"):
        history.check_root(tmp_path)


def test_a_root_that_is_a_file_or_under_one_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputPathError, match="is a file, not a folder"):
        history.check_root(tmp_path / "f")
    with pytest.raises(OutputPathError, match="cannot be made"):
        history.check_root(tmp_path / "f" / "sub")
    history.check_root(tmp_path / "new" / "root")
    assert not (tmp_path / "new").exists()  # checking writes nothing


def test_history_files_honour_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        history.append(tmp_path, {"format": 2, "case_id": "a"})
        modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    finally:
        os.umask(old)
    assert modes == {history.NAME: 0o640, ".history.lock": 0o640}


# ------------------------------------------------------------------------------ the page


def _run(date, verdict="PASS", margin=100.0):
    return {"format": 2, "case_id": "converge__m__w4__s9__fp32", "hardware": "cpu", "precision": "fp32",
            "date": date, "verdict": verdict, "margin": margin, "run": "runs/x"}


def test_the_page_flags_a_shrunk_margin_and_a_changed_verdict():
    steady = [_run(f"2026-01-0{d}T00:00:00", margin=m) for d, m in enumerate((100, 90, 110, 95), 1)]
    assert nightly_report.flag(steady)[0] == ""
    note, now, med = nightly_report.flag(steady + [_run("2026-01-06T00:00:00", margin=40)])
    assert "margin shrank 2.4x" in note and now == 40 and med == 95
    note, _, _ = nightly_report.flag(steady + [_run("2026-01-06T00:00:00", verdict="NOT EXERCISED")])
    assert note == "verdict changed: PASS -> NOT EXERCISED"
    window = [_run(f"2026-01-{d:02d}T00:00:00", margin=10) for d in range(1, 9)] + \
        [_run(f"2026-01-{d:02d}T00:00:00", margin=1000) for d in range(9, 16)]
    assert nightly_report.flag(window)[2] == 1000  # the median of the last 7 runs only


FLIP = {"target": "dcp vs bshd: routes equal until step 12, then ...", "pass": True, "value": 1e-6, "limit": 3e-5,
        "route_difference": {"step": 11}}


@pytest.mark.parametrize("model, dtype, checks, rule", [
    ("tiny-gpt", "bfloat16", [], (30, "bf16 rounding")), ("tiny-moe", "bfloat16", [FLIP], (20, "MoE routing")),
    ("tiny-moe", "float32", [], (None, "MoE routing")), ("tiny-moe", "float32", [FLIP], (11, "MoE routing")),
    ("tiny-moe", "float32", [{**FLIP, "pass": False}], (20, "MoE routing")),
    ("tiny-gpt", "float32", [], (None, ""))])
def test_each_history_line_records_the_rule_its_run_was_judged_by(tmp_path, model, dtype, checks, rule):
    """fp32 MoE runs: the span their routes set (every step while routes agree, up to a near-tie flip, the fixed
    span after a routing bug); bf16 and dense runs: the fixed rule."""
    from types import SimpleNamespace

    rows = {"bshd": [{"loss": 1.0, "tokens_per_s": 10.0}]}
    res = SimpleNamespace(rows=rows, checks=checks, case_id="converge__x__w4__bf16", verdict="PASS",
                          run_dir=tmp_path / "r", config={"model": model, "dtype": dtype, "hardware": "h200", "world": 4})
    e = history.entry(res, role=nc.DISTRIBUTED, root=tmp_path, producer=golden.producer(), extra_checks=[])
    assert (e["rule"]["strict_steps"], e["rule"]["why"]) == rule
    assert (e["rule"]["late_window"], e["rule"]["late_band"]) == (converge.LATE_WINDOW, converge.LATE_BAND)


def _deviation_panel(tmp_path, rule, steps=100):
    """The latest-run figure's deviation panel of a ``steps``-step bf16 run whose thd curve leaves the per-step
    band after step 30 (as bf16 rounding does) and stays on the late mean."""
    ref = [5.0 - 0.02 * i for i in range(steps)]
    thd = [r + (0.0 if i < 30 else 0.004 * (-1) ** i) for i, r in enumerate(ref)]
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    rows = {lay: [{"loss": v} for v in ys] for lay, ys in (("bshd", ref), ("thd", thd))}
    (run / "results.json").write_text(json.dumps({"layouts": rows, "config": {}}))
    e = _run("2026-01-01T00:00:00") | {"tolerance": 2e-3} | ({"rule": rule} if rule else {})
    return nightly_report._latest_curves(tmp_path, "h200 bf16", e).axes[1]


def _band_steps(ax) -> list[tuple[float, float]]:
    return [(round(c.get_paths()[0].vertices[:, 0].min()), round(c.get_paths()[0].vertices[:, 0].max()))
            for c in ax.collections]


def test_the_deviation_panel_draws_each_band_where_its_rule_holds(tmp_path):
    """bf16 past 30 steps: the per-step band over steps 1-30 only, the late window's band (1% of the reference's
    late mean) over the last 10 steps with each layout's late-mean deviation as a bar; a rule without a strict
    span (fp32, or a line written before the rule was recorded) keeps one band over every step."""
    ax = _deviation_panel(tmp_path, {"strict_steps": 30, "why": "bf16 rounding", "late_window": 10, "late_band": 0.01})
    assert _band_steps(ax) == [(1, 30), (91, 100)]
    late = ax.collections[1].get_paths()[0].vertices[:, 1]
    ref_late = sum(5.0 - 0.02 * i for i in range(90, 100)) / 10
    assert max(late) == pytest.approx(0.01 * ref_late)
    bars = [ln for ln in ax.lines if list(ln.get_xdata()) == [91, 100]]
    assert [ln.get_ydata()[0] for ln in bars] == pytest.approx([0.0, 0.0], abs=1e-12)
    assert "first 30 (bf16 rounding)" in ax.get_title()
    assert _band_steps(_deviation_panel(tmp_path / "fp32", None)) == [(1, 100)]
    # an MoE run whose routes parted at a near-tie in its first step: no step held per step, the late band only
    flip = _deviation_panel(tmp_path / "moe", {"strict_steps": 0, "why": "MoE routing", "late_window": 10,
                                               "late_band": 0.01})
    assert _band_steps(flip) == [(91, 100)] and "first 0 (MoE routing)" in flip.get_title()


def test_a_diverged_run_still_draws_its_panel(tmp_path):
    """A run whose loss became inf and NaN (the night the page matters most) is drawn: the scale is set by the
    finite deviations and the per-step band (it raised 'Axis limits cannot be NaN or Inf')."""
    ref = [5.0 - 0.02 * i for i in range(100)]
    thd = ref[:95] + [math.inf, math.nan] + ref[97:]
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    rows = {lay: [{"loss": v} for v in ys] for lay, ys in (("bshd", ref), ("thd", thd))}
    (run / "results.json").write_text(json.dumps({"layouts": rows, "config": {}}))
    e = _run("2026-01-01T00:00:00", verdict="FAIL") | {"tolerance": 2e-3, "rule": {
        "strict_steps": 30, "why": "bf16 rounding", "late_window": 10, "late_band": 0.01}}
    ax = nightly_report._latest_curves(tmp_path, "h200 bf16", e).axes[1]
    assert ax.get_ylim() == pytest.approx((-2.4e-3, 2.4e-3))  # 1.2 x the per-step band: every finite deviation is 0


def test_a_diverged_case_gets_its_history_line_and_its_page(tmp_path):
    """The night a loss turns NaN: the case's history line is written (a NaN in it raised "Out of range float
    values are not JSON compliant" and stopped the nightly before the page), as strict JSON with null where the NaN
    was, and the page draws the case: its trends from that line, its latest run's curves from the results.json
    that converge writes (null losses there too)."""
    from types import SimpleNamespace

    from harness.io import atomic_write_json

    ref = [5.0 - 0.02 * i for i in range(40)]
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    rows = {lay: [{"loss": v, "tokens_per_s": 10.0} for v in ys] for lay, ys in (("bshd", ref),
                                                                                ("thd", ref[:20] + [math.nan] * 20))}
    atomic_write_json(run / "results.json", {"layouts": rows, "config": {}})  # as converge writes it
    assert '"loss": null' in (run / "results.json").read_text()
    checks = [{"target": "thd vs bshd: max |delta loss| (first 30 steps) <= 0.004", "value": math.nan, "limit": 0.004,
               "pass": False}]
    res = SimpleNamespace(rows=rows, checks=checks, case_id="converge__x__w4__bf16", verdict="FAIL", run_dir=run,
                          config={"model": "tiny-gpt", "dtype": "bfloat16", "hardware": "h200", "world": 4})
    history.append(tmp_path, history.entry(res, role=nc.DISTRIBUTED, root=tmp_path, producer=golden.producer(),
                                           extra_checks=[]))
    (line,) = history.read(tmp_path)
    assert line["last_loss"] == {"bshd": ref[-1], "thd": None} and line["max_delta"] == {"thd": None}
    assert (line["verdict"], line["margin"], line["failed"]) == ("FAIL", 0.0, [checks[0]["target"]])
    html = nightly_report.render(history.read(tmp_path), tmp_path).read_text()
    assert "FAIL" in html and "max |delta loss| (first 30 steps) &lt;= 0.004" in html  # the failed check, named
    assert html.count("<img") >= 2  # the trends and the latest run's curves


def test_the_late_window_is_the_runs_last_steps_when_the_golden_is_longer(tmp_path):
    """A golden of N steps serves every shorter run: the panel draws the run's 50 steps against the golden's first
    50 (it raised on the lengths' mismatch, so the page of a ``--steps 50`` nightly failed to draw), and the late
    window is the run's last 10 steps (41-50), not the golden's own last ten."""
    ref = [5.0 - 0.02 * i for i in range(100)]
    golden_file = tmp_path / "golden.json"
    golden_file.write_text(json.dumps({"data": {"bshd": ref}}))
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    rows = {"thd": [{"loss": v} for v in ref[:50]]}
    (run / "results.json").write_text(json.dumps({"layouts": rows, "config": {"golden": str(golden_file)}}))
    e = _run("2026-01-01T00:00:00") | {"tolerance": 1e-5, "rule": {"strict_steps": 20, "why": "MoE routing",
                                                                   "late_window": 10, "late_band": 0.01}}
    ax = nightly_report._latest_curves(tmp_path, "cpu fp32", e).axes[1]
    assert _band_steps(ax) == [(1, 20), (41, 50)]
    (bar,) = [ln for ln in ax.lines if list(ln.get_xdata()) == [41, 50]]
    assert bar.get_ydata()[0] == pytest.approx(0.0, abs=1e-12)  # the run equals the golden on its own steps


# -------------------------------------------------------------------------- the producer


def _git(*args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "commit.gpgsign=false",
                           "-c", "core.hooksPath=/dev/null", *args], cwd=cwd, capture_output=True, text=True,
                          check=True, env=env).stdout.strip()


def _producer_from(cwd: Path, pythonpath: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | {"PYTHONPATH": str(pythonpath)}
    code = "from harness import golden; print(golden.producer()['git_rev'])"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def test_the_producer_names_the_harness_code_not_the_current_folder(tmp_path):
    """Run from inside another repository, the revision is the harness checkout's; a copy of the package
    outside any checkout says ``installed <version>``."""
    other = tmp_path / "other"
    other.mkdir()
    _git("init", "-q", cwd=other)
    (other / "x").write_text("x")
    _git("add", "x", cwd=other)
    _git("commit", "-qm", "c", cwd=other)
    theirs = _git("rev-parse", "--short", "HEAD", cwd=other)
    ours = golden.source_revision()
    assert _producer_from(other, REPO).split("+")[0] == ours.split("+")[0] != theirs
    site = other / "site"
    shutil.copytree(REPO / "harness", site / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    from harness import __version__

    assert _producer_from(other, site) == f"installed {__version__}"


# ------------------------------------------------------------------------------ bad input


def test_bad_nightly_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / history.NAME).write_text(json.dumps({"format": 99, "case_id": "x"}) + "\n")
    root = tmp_path / "root"
    cases = [(["--world", "1"], "could only be NOT EXERCISED"), (["--world", "6"], "nightly --world 6"),
             (["--models", "tiny-gpt,nope"], "unknown model(s) 'nope'"),
             (["--root", str(tmp_path / "afile")], "is a file, not a folder"),
             (["--root", str(tmp_path / "afile" / "sub")], "cannot be made"),
             (["--root", str(newer)], "written by a newer dcp-harness"),
             (["--steps", "300", "--world", "2"], "or fewer"),
             (["--only", "w4_pp2,tiny_moe"], "nightly --only tiny_moe: no case of this run has that in its id; the "
                                            "ids are converge__tiny_gpt__w4__m128")]
    for args, expect in cases:
        argv = ["nightly", "--device", "cpu", "--models", "tiny-gpt", "--root", str(root), *args]
        assert cli.main(argv) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dcp-harness: error: ") and expect in err[0], (args, err)
    assert not root.exists() and sorted(p.name for p in newer.iterdir()) == [history.NAME]


# ------------------------------------------------------------------------- real runs (slow)


@pytest.mark.slow
def test_converge_on_one_rank_is_not_exercised_in_console_json_and_page(tmp_path, capsys):
    code = cli.main(["converge", "--world", "1", "--steps", "2", "--layouts", "bshd,dcp", "--max-seqlen-per-rank", "1024",
                     "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: NOT EXERCISED" in out and "[NOT EXERCISED] dcp: micro-batches" in out
    assert "PASS" not in out.split("[dcp ]")[-1].split("verdict:")[-1]
    (run,) = tmp_path.glob("converge-*")
    doc = json.loads((run / "results.json").read_text())
    assert doc["verdict"] == converge.NOT_EXERCISED
    assert doc["config"]["dcp_exercise"] | {"cp_groups": None} == {
        "cp_groups": None, "distinct_sizes": 1, "microbatches": doc["config"]["dcp_exercise"]["microbatches"],
        "microbatches_cp_gt1": 0, "largest": 1, "steps": 2, "steps_mixed": 0}
    assert list(doc["config"]["dcp_exercise"]["cp_groups"]) == ["1"]
    assert ">NOT EXERCISED<" in (run / "index.html").read_text()


def test_a_case_stopped_by_sigterm_is_a_failed_line_and_the_page_shows_it(tmp_path):
    """A scheduler's time limit ends the nightly mid-case: the case is recorded as FAIL ("interrupted", naming the
    log), the page is redrawn with it, and the job still ends as an interrupted CLI does (143)."""
    import signal

    root = tmp_path / "n"
    proc = subprocess.Popen([sys.executable, "-m", "harness", "nightly", "--device", "cpu", "--models", "tiny-gpt",
                             "--world", "2", "--root", str(root)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "step    1/100" in line:
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert "FAIL (interrupted: signal SIGTERM" in out
    (e,) = history.read(root)
    assert e["verdict"] == "FAIL" and e["case_id"].startswith("converge__tiny_gpt__w2__lognormal")
    (why,) = e["failed"]
    assert why.startswith("the job failed: interrupted (signal SIGTERM) before the case finished; output: ")
    assert Path(why.rsplit("; output: ", 1)[1]).is_file()
    page = (root / "index.html").read_text()
    assert e["case_id"] in page and "interrupted (signal SIGTERM)" in page


@pytest.mark.slow
def test_a_nightly_case_that_never_forms_a_cp_group_is_not_exercised_and_exits_1(tmp_path, capsys):
    """A world of one rank, which ``choose`` refuses, run directly: the verdict reaches the history,
    the page and the summary, and the exit status is 1."""
    case = nc.NightlyCase(TrainConfig(model="tiny-gpt", steps=2, layouts=("bshd", "dcp"), max_seqlen_per_rank=1024),
                          1, nc.DISTRIBUTED)
    from harness.apps import nightly

    assert nightly.run_cases([case], root=str(tmp_path / "n"), json_path=str(tmp_path / "s.json")) == 1  # str paths too
    out = capsys.readouterr().out
    assert f"nightly {case.case_id}: NOT EXERCISED" in out and "verdict: NOT EXERCISED (0/1" in out
    (entry,) = history.read(tmp_path / "n")
    assert entry["verdict"] == "NOT EXERCISED" and entry["dcp_exercise"]["microbatches_cp_gt1"] == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["verdict"] == "NOT EXERCISED" and summary["exit_code"] == 1
    assert "NOT EXERCISED</span>" in (tmp_path / "n" / "index.html").read_text()


def test_every_default_cpu_case_has_its_committed_golden():
    """The CPU nightly is checked against goldens: each distributed case's reference golden is committed."""
    plan = nc.choose(models=nc.NIGHTLY_MODELS, steps=100, device="cpu", world=None, gpus=0)
    assert plan.line.endswith("goldens: 8 of 8 cases have a committed golden"), plan.line
