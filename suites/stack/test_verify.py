"""The stack protocol (``harness.stack``) and ``dcp-harness verify``: the harness's runtime and the README's worked
example (a plain-PyTorch trainer, ``docs/examples/own_trainer.py``) pass against their own one-rank runs; each bug
planted in the example fails the check that names it; a stack that breaks the protocol, or cannot be found, gets
one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harness.apps.verify import verify
from harness.data.corpus import CorpusConfig
from harness.stack.drive import load_factory
from harness.stack.protocol import StackError
from harness.train.config import TrainConfig

pytestmark = [pytest.mark.dist_cpu, pytest.mark.usefixtures("shared_zygote")]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = f"{ROOT / 'docs/examples/own_trainer.py'}:make"
SMALL = TrainConfig(steps=2, max_seqlen_per_rank=64, corpus=CorpusConfig(
    lengths="lognormal:mean=48,sigma=0.8,min=8,max=200", sequences_per_batch=8, vocab=64))
"""Two steps of 8 sequences (the longest 99 tokens): static CP 2 at 2 ranks; dcp forms blocks of 1 and 2."""


def _failed(res) -> list[str]:
    return [c["target"] for c in res.checks if not c["pass"]]


@pytest.mark.parametrize("stack", ["harness", EXAMPLE])
def test_a_correct_stack_passes_every_check(stack, tmp_path):
    res = verify(stack, SMALL, world=2, out=tmp_path, spawn=True)
    assert res.verdict == "PASS", _failed(res)
    kinds = {c["target"].split(": ", 1)[1].split(",")[0] for c in res.checks}
    assert len(res.checks) == 3 * 9 + 1 and len(kinds) >= 9, kinds  # every check ran, for every layout
    assert [c["value"] for c in res.checks if c.get("exercise")] == [2]  # step 1: 74 and 99 tokens > 64 per rank
    assert (tmp_path / "verify.json").exists() and not (tmp_path / "verify-work").exists()


def test_a_dcp_step_1_without_a_cp_group_is_not_exercised_and_writes_no_golden(tmp_path):
    """Step 1's longest sequence (99 tokens) fits 100 tokens per rank: dcp runs it at CP 1, the step-1 gradient
    and token-loss checks never see a CP group, and the verdict says so (not PASS) with the seed that needs CP;
    such a run writes no golden."""

    roomy = replace(SMALL, steps=1, max_seqlen_per_rank=100)
    res = verify(EXAMPLE, roomy, world=2, out=tmp_path / "a", spawn=True)
    assert res.verdict == "NOT EXERCISED", _failed(res)
    assert [c for c in _failed(res)] == [c["target"] for c in res.checks if c.get("exercise")]
    line = _failed(res)[0]
    assert "0 of" in line and "CP sizes [1]" in line and "99 tokens, fits 100 tokens per rank" in line, line
    assert re.search(r"--seed \d+ gives a step 1 that needs CP > 1", line), line
    with pytest.raises(StackError, match="verdict is NOT EXERCISED"):
        verify(EXAMPLE, roomy, world=2, out=tmp_path / "b", spawn=True, golden="update", golden_root=tmp_path / "g")


def test_verify_defaults_to_the_first_seed_whose_step_1_needs_cp():
    """The default corpus at 2 ranks: seed 0's step 1 (longest 457) fits 484 tokens per rank, seed 1's does not;
    at 4 ranks seed 0 already needs CP. A capacity the user gives is kept, and a seed whose longest sequence the
    static layouts cannot fit there is passed over; without a dcp layout nothing changes."""

    from harness.apps.verify import default_max_seqlen, exercising, step1_needs_cp
    from harness.train.config import longest_sequence

    cfg = TrainConfig(steps=3)
    assert not step1_needs_cp(replace(cfg, max_seqlen_per_rank=default_max_seqlen(cfg, 2)), 2)
    two, four = exercising(cfg, 2), exercising(cfg, 4)
    assert (two.corpus.seed, two.max_seqlen_per_rank) == (1, 512) and step1_needs_cp(two, 2)
    assert (four.corpus.seed, four.max_seqlen_per_rank) == (0, 256)
    kept = exercising(cfg, 2, capacity=600)
    assert kept.max_seqlen_per_rank == 600 and step1_needs_cp(kept, 2)
    assert longest_sequence(kept) <= 2 * 600
    assert exercising(replace(cfg, layouts=("bshd", "thd")), 2).corpus.seed == 0
    assert exercising(cfg, 1).corpus.seed == 0


PLANTED = {
    "duplicated-tokens": "loss divided by the global batch's loss tokens",
    "local-positions": "step-1 token losses",
    "labels-after-split": "step-1 token losses",
    "cp-grads-not-reduced": "step-1 gradients",
    "separate-kv-gathers": "step-1 gradients",
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_bug_planted_in_the_example_fails_its_check(bug, tmp_path):
    res = verify(EXAMPLE, SMALL, world=2, out=tmp_path, options={"bug": bug}, spawn=True)
    assert res.verdict == "FAIL"
    assert any(PLANTED[bug] in t for t in _failed(res)), _failed(res)


def test_the_check_names_the_micro_batch_that_ran_in_another_group(tmp_path):
    """A stack that runs every micro-batch in the first block's group (kept from an earlier micro-batch): only dcp
    forms blocks of one rank, and the line names the first micro-batch that ran in the wrong one."""
    stale = tmp_path / "stale.py"
    examples = str(ROOT / "docs/examples")
    stale.write_text(
        f"import sys\nsys.path.insert(0, {examples!r})\nimport own_trainer\n\n"
        "class Stale(own_trainer.OwnTrainer):\n"
        "    def step(self, request):\n"
        "        r = super().step(request)\n"
        "        r.cp_groups = {m: (0, 1) for m in r.cp_groups}  # every micro-batch in the first block's group\n"
        "        return r\n\n"
        "def make(ctx):\n    return Stale(ctx)\n")
    res = verify(f"{stale}:make", SMALL, world=2, out=str(tmp_path / "out"), spawn=True)  # a str path too
    bad = [t for t in _failed(res) if "block's CP group" in t]
    assert bad == [t for t in _failed(res) if t.startswith("dcp")] and "its block is (0,)" in bad[0], _failed(res)


def test_stack_specs_that_name_nothing_are_refused_in_one_line(tmp_path):
    for spec, match in [("nowhere.py:make", "does not exist"), ("harness.stack.runtime:nothing", "no function"),
                        ("no_such_module_xyz:make", "cannot be imported"), ("make", "is not 'path/to/file.py")]:
        with pytest.raises(StackError, match=match):
            load_factory(spec)
    r = subprocess.run([sys.executable, "-m", "harness", "verify", str(tmp_path / "missing.py") + ":make"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr, r.stderr


def test_a_report_of_the_wrong_form_ends_the_job_naming_the_rank_and_the_field(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from harness.stack import StepReport\n\n"
        "class Bad:\n    name = 'bad'\n    def build(self, seed):\n        pass\n"
        "    def step(self, request):\n        return StepReport(loss='0.5', grad_norm=1.0, tokens=1)\n\n"
        "def make(ctx):\n    return Bad()\n")
    r = subprocess.run([sys.executable, "-m", "harness", "verify", f"{bad}:make", "--world", "2", "--steps", "1",
                        "--batch-size", "4", "--lengths", "const:value=16", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 3, r.stderr
    assert re.search(r"rank [01] failed first", r.stderr) and "StepReport.loss must be a Python float" in r.stderr, r.stderr


HARNESS_FAULTS = {
    "rope-positions-per-rank": "step-1 gradients",
    "loss-tokens-per-cp-rank": "step-1 gradients",
    "zigzag-r-plus-cp": "step-1 gradients",
}
"""Faults of the catalogue in the harness's runtime: verify catches them through the protocol alone."""


@pytest.mark.parametrize("fault", sorted(HARNESS_FAULTS))
def test_a_catalogue_fault_planted_in_the_harness_runtime_fails_verify(fault, tmp_path):
    res = verify("harness", SMALL, world=2, out=tmp_path, spawn=True, plant=fault)
    assert res.verdict == "FAIL"
    assert any(HARNESS_FAULTS[fault] in t for t in _failed(res)), _failed(res)


def test_plant_is_refused_for_a_stack_other_than_the_harness(tmp_path):
    with pytest.raises(StackError, match="applies to the stack 'harness' only"):
        verify(EXAMPLE, SMALL, world=2, out=tmp_path, spawn=True, plant="rope-positions-per-rank")


def test_a_golden_holds_both_runs_and_catches_a_change_that_moves_them_together(tmp_path):
    """A golden written from a passing run is met by the same run; a trainer whose learning rate changed moves the
    layouts and their one-rank reference together (every reference check passes) and only the golden fails it; a
    FAIL run or a planted fault cannot write one."""
    gold = tmp_path / "golden"
    first = verify(EXAMPLE, SMALL, world=2, out=tmp_path / "a", spawn=True, golden="update", golden_root=gold)
    assert first.verdict == "PASS" and first.golden and Path(first.golden).is_file(), first.golden
    assert Path(first.golden).name.startswith("verify__own-trainer-make__"), first.golden
    again = verify(EXAMPLE, SMALL, world=2, out=tmp_path / "b", spawn=True, golden="require", golden_root=gold)
    assert again.verdict == "PASS", _failed(again)
    assert sum("vs golden (cpu)" in c["target"] for c in again.checks) == 2 * 4  # 3 layouts + the reference
    changed = tmp_path / "changed" / "own_trainer.py"  # the same trainer, its default learning rate doubled
    changed.parent.mkdir()
    text = (ROOT / "docs/examples/own_trainer.py").read_text()
    changed.write_text(text.replace("lr: float = 3e-3) -> OwnTrainer", "lr: float = 6e-3) -> OwnTrainer"))
    moved = verify(f"{changed}:make", SMALL, world=2, out=tmp_path / "c", spawn=True, golden="auto", golden_root=gold)
    bad = _failed(moved)
    assert bad and all("vs golden (cpu)" in t for t in bad), bad
    assert any(t.startswith("reference vs golden") for t in bad), bad

    from harness.golden import GoldenError

    short = tmp_path / "short"  # a golden of one step cannot judge a run of two: curves of other lengths
    verify(EXAMPLE, replace(SMALL, steps=1), world=2, out=tmp_path / "f", spawn=True, golden="update", golden_root=short)
    with pytest.raises(GoldenError, match=r"holds 1 steps of bshd.loss, this run trains 2"):
        verify(EXAMPLE, SMALL, world=2, out=tmp_path / "f", spawn=True, golden="require", golden_root=short)
    with pytest.raises(GoldenError, match=r"is missing; create it with: dcp-harness verify \S+own_trainer.py:make "
                                          r"--device cpu --world 2 --steps 2 --max-seqlen-per-rank 64 .*--update-golden"):
        verify(EXAMPLE, SMALL, world=2, out=tmp_path / "g", spawn=True, golden="require", golden_root=tmp_path / "none")
    with pytest.raises(StackError, match="verdict is FAIL"):
        verify(EXAMPLE, SMALL, world=2, out=tmp_path / "d", spawn=True, golden="update", golden_root=tmp_path / "g2",
               options={"bug": "local-positions"})
    with pytest.raises(StackError, match="golden of a planted bug"):
        verify("harness", SMALL, world=2, out=tmp_path / "e", spawn=True, golden="update", plant="zigzag-r-plus-cp")


def test_megatron_cores_own_scheduler_drives_the_dcp_layout(tmp_path):
    """``--scheduler megatron-core``: the installed megatron-core's ``BalancedCPScheduler`` lays out every dcp step
    (as its data-iterator wrapper would) and the run still meets its one-rank reference; a scheduler name that is
    neither the harness's nor upstream's is refused in one line."""

    from harness.plan.errors import LayoutError
    from harness.upstream import megatron as upstream

    if not upstream.available():
        pytest.skip("megatron-core is not installed")
    from harness.data.corpus import batch_lengths
    from harness.train import layouts

    cfg = replace(SMALL, scheduler="megatron-core", layouts=("dcp",))
    for k in range(cfg.steps):  # the dcp layout is upstream's own output, micro-batch by micro-batch
        lengths = batch_lengths(cfg.corpus, k)
        sched = layouts.plan("dcp", lengths, cfg.layout_config(2))[0]
        assert sched.algorithm == "megatron-core"
        assert layouts.sample_id_groups(sched) == upstream.sample_id_groups(
            lengths, n_ranks=2, max_seqlen_per_rank=cfg.max_seqlen_per_rank)
    res = verify("harness", cfg, world=2, out=tmp_path, spawn=True)
    assert res.verdict == "PASS", _failed(res)
    with pytest.raises(LayoutError, match="or megatron-core"):
        verify("harness", replace(SMALL, scheduler="megatron-corez"), world=2, out=tmp_path, spawn=True)


def test_megatron_cores_scheduler_without_megatron_core_is_one_line(monkeypatch):
    from harness.plan.errors import LayoutError
    from harness.train import layouts
    from harness.upstream import megatron as upstream

    monkeypatch.setattr(upstream, "available", lambda: False)
    cfg = layouts.LayoutConfig(n_ranks=2, max_seqlen_per_rank=64, static_cp=2, scheduler="megatron-core")
    with pytest.raises(LayoutError, match="megatron-core cannot be imported here: pip install megatron-core"):
        layouts.plan("dcp", [40, 30, 20], cfg)


def test_the_megatron_core_step_benchmark_summary_takes_medians_of_runs_and_per_run_ratios():
    """``bench step --stack megatron-core``'s summary (no GPU needed): per arm the median over runs of each run's
    median step; each ratio is slow / fast per run, its median over runs; MFU from the real tokens' FLOPs."""
    from harness.bench.stack_step import summarize
    from harness.bench.step.config import StepBenchConfig

    def run(static, mc, bal):
        return {a: {"ms": ms, "flops": [989e12 * 4 * m / 1e3 * 0.5 for m in ms], "sequences_by_cp": {}}
                for a, ms in (("static", static), ("megatron-core", mc), ("balanced", bal))}

    res = {"ranks": [{"device": "NVIDIA H200", "runs": [run([300, 100, 200], [100, 50, 150], [100, 100, 100]),
                                                        run([400, 400, 400], [200, 200, 200], [100, 100, 100]),
                                                        run([500, 500, 500], [100, 100, 100], [125, 125, 125])]}]}
    s = summarize(res, StepBenchConfig(), 4, ["static", "megatron-core", "balanced"])
    assert s["arms"]["static"]["median_ms"] == 400 and s["arms"]["megatron-core"]["median_ms"] == 100
    assert s["ratios"]["megatron-core dynamic CP vs static CP"]["per_run"] == [2.0, 2.0, 5.0]
    assert s["ratios"]["megatron-core dynamic CP vs static CP"]["median"] == 2.0
    assert s["ratios"]["balanced vs megatron-core's scheduler"]["per_run"] == [1.0, 2.0, 0.8]
    assert abs(s["arms"]["balanced"]["mfu"] - 0.5) < 1e-12  # half the H200's dense bf16 peak on every step
    assert s["checks"] == []  # a job from before the compile count: nothing to judge
    res["ranks"][0]["runs"][2]["balanced"]["compiles"] = [0, 3, 0]  # megatron-core's fusions compile (torch.compile)
    for arm in ("static", "megatron-core"):
        res["ranks"][0]["runs"][2][arm]["compiles"] = [0, 0, 0]
    (c,) = summarize(res, StepBenchConfig(), 4, ["static", "megatron-core", "balanced"])["checks"]
    assert c["pass"] is False and c["target"].endswith(": balanced 1 of 3") and c["shown"] == "1 of 9 steps compiled"
    assert s["hosts"] == [None] and s["host_line"] == ""  # a rank that did not probe (a job from before the probe)
    probed = {"cpu": "x", "logical_cpus": 8, "usable_cpus": 8, "launch_us": 5.0, "python_mops": 30.0}
    res["ranks"].append({**res["ranks"][0], "host": probed})
    assert summarize(res, StepBenchConfig(), 4, ["static", "megatron-core", "balanced"])["host_line"].startswith(
        "host: x (8 CPUs, 8 usable), 5.0 us per operator launch")


def test_the_driver_reports_every_step_to_the_launchers_watchdog(tmp_path):
    """A stack's steps beat the job's heartbeat (layout, step, of): a slow stack is not taken for a stuck one."""
    import json

    from harness.jobs.launch import run_on_ranks
    from harness.stack.drive import job

    beats = tmp_path / "beats"
    beats.mkdir()
    cfg = {**SMALL.to_dict(), "stack": "harness", "options": {}, "report_dir": str(tmp_path / "reports"),
           "inline": False, "heartbeat_dir": str(beats)}
    run_on_ranks(job, world_size=2, tmp_path=tmp_path, args=(cfg,), timeout_s=120)
    for r in (0, 1):
        last = json.loads((beats / f"rank{r}.json").read_text())
        assert (last["rank"], last["layout"], last["step"], last["of"]) == (r, SMALL.layouts[-1], SMALL.steps,
                                                                            SMALL.steps)


def test_the_harness_stack_pads_to_the_token_bucket_and_a_padding_bug_fails_verify(tmp_path):
    """``--option token_bucket=N`` pads the harness stack's thd / dcp micro-batches as ``converge`` and ``bench step``
    do (``auto``: 64 on CUDA, off on the CPU): the padded run still passes, and the loss divided by the processed
    tokens (padding included: ``loss-counts-padding``) fails the step-1 gradients; a bad bucket is one line."""
    import base64
    import pickle

    from harness.jobs.launch import run_on_ranks
    from harness.stack.drive import job
    from harness.stack.protocol import StackContext
    from harness.stack.runtime import make

    cfg = {**SMALL.to_dict(), "stack": "harness", "options": {"token_bucket": 16}, "inline": True}
    ranks = [pickle.loads(base64.b64decode(x["inline"]))  # noqa: S301 - this test's own ranks
             for x in run_on_ranks(job, world_size=2, tmp_path=tmp_path / "job", args=(cfg,), timeout_s=120)]
    for lay in ("bshd", "thd", "dcp"):
        for k in range(SMALL.steps):
            reps = [r["layouts"][lay]["reports"][k] for r in ranks]
            mine = [rep.extra["processed_tokens"] for rep in reps]
            assert sum(mine) >= reps[0].tokens > 0, (lay, k, mine, reps[0].tokens)  # every real token, and padding
            if lay != "bshd":  # bshd pads every sequence to its fixed length instead
                assert all(t % 16 == 0 for t in mine), (lay, k, mine)
    res = verify("harness", SMALL, world=2, out=tmp_path / "ok", spawn=True, options={"token_bucket": 16})
    assert res.verdict == "PASS", _failed(res)
    bad = verify("harness", SMALL, world=2, out=tmp_path / "bad", spawn=True, options={"token_bucket": 16},
                 plant="loss-counts-padding")
    assert bad.verdict == "FAIL" and any("step-1 gradients" in t for t in _failed(bad)), _failed(bad)
    ctx = StackContext(rank=0, world=1, device="cpu", dtype="float32", vocab=64)
    assert make(ctx).token_bucket == "auto"
    with pytest.raises(StackError, match=r"token_bucket must be 'auto', 0 \(off\) or an even int of tokens, got 7 "
                                         r"\(--option token_bucket=auto\|N\)"):
        make(ctx, token_bucket=7)


BF16 = TrainConfig(steps=1, max_seqlen_per_rank=64, dtype="bfloat16", corpus=SMALL.corpus)
"""SMALL's step 1 in bf16 (CPU autocast): the sharp step's case."""


def _sharp(res) -> list[dict]:
    return [c for c in res.checks if "queries and keys x16" in c["target"]]


@pytest.mark.parametrize("stack", ["harness", EXAMPLE])
def test_a_bf16_run_holds_a_sharp_step_one_to_the_reference(stack, tmp_path):
    res = verify(stack, BF16, world=2, out=tmp_path, spawn=True)
    assert res.verdict == "PASS", _failed(res)
    lines = _sharp(res)
    assert len(lines) == 3 * 2 + 1 and not res.notes, [c["target"] for c in lines]  # per layout 2, took effect 1
    moved = next(c for c in lines if c["target"].startswith("reference:"))
    assert moved["value"] > 0.1, moved  # the sharpened model trains a different step 1


def test_a_rope_offset_bug_passes_bf16s_step_one_bands_and_only_the_sharp_step_sees_it(tmp_path):
    """RoPE positions numbered per zig-zag rank: at initialisation attention is near uniform, so in bf16 the plain
    step 1 stays within its bands (every plain line passes); from queries and keys x16 the step-1 gradients of every
    layout (static CP 2 and dynamic CP alike) leave the band."""
    res = verify("harness", BF16, world=2, out=tmp_path, spawn=True, plant="rope-positions-per-rank")
    failed = _failed(res)
    assert res.verdict == "FAIL"
    assert failed and all("queries and keys x16: step-1 gradients" in t for t in failed), failed
    assert {t.split(" vs ")[0] for t in failed} == {"bshd", "thd", "dcp"}, failed


def test_a_stack_without_sharpen_gets_a_note_and_one_whose_sharpen_changes_nothing_is_not_exercised(tmp_path):
    stacks = tmp_path / "stacks.py"
    examples = str(ROOT / "docs/examples")
    stacks.write_text(
        f"import sys\nsys.path.insert(0, {examples!r})\nimport own_trainer\n\n"
        "class Blunt(own_trainer.OwnTrainer):\n    sharpen = None\n\n"
        "class Copying(own_trainer.OwnTrainer):\n"
        "    def sharpen(self, scale):\n"
        "        self.model.qkv.weight.detach().clone().mul_(scale)  # scales a copy: the model stays as built\n\n"
        "def make(ctx, kind):\n    return {'blunt': Blunt, 'copying': Copying}[kind](ctx)\n")
    blunt = verify(f"{stacks}:make", BF16, world=2, out=tmp_path / "a", spawn=True, options={"kind": "blunt"})
    assert blunt.verdict == "PASS" and not _sharp(blunt), _failed(blunt)
    assert len(blunt.notes) == 1 and "offers no sharpen(scale)" in blunt.notes[0], blunt.notes
    copying = verify(f"{stacks}:make", BF16, world=2, out=tmp_path / "b", spawn=True, options={"kind": "copying"})
    assert copying.verdict == "NOT EXERCISED" and _failed(copying) == [
        c["target"] for c in _sharp(copying) if c["target"].startswith("reference:")], _failed(copying)
    fp32 = verify(f"{stacks}:make", replace(BF16, dtype="float32"), world=2, out=tmp_path / "c", spawn=True,
                  options={"kind": "blunt"})
    assert fp32.verdict == "PASS" and not fp32.notes  # fp32's own bands see step-1 position bugs: no sharp step


@pytest.mark.parametrize("value", ["sharp", 0.5, float("inf"), -4])
def test_a_sharp_scale_that_is_not_auto_off_or_at_least_one_is_refused_naming_it(value, tmp_path):
    with pytest.raises(StackError, match=r"sharp scale .*give auto \(x16 in bf16, off in fp32\), off, or a finite"):
        verify("harness", BF16, world=2, out=tmp_path, spawn=True, sharp=value)
    from harness.stack.checks import sharp_scale

    assert [sharp_scale(v, d) for v, d in [("auto", "bfloat16"), ("auto", "float32"), ("off", "bfloat16"),
                                           ("8", "float32"), (1, "bfloat16")]] == [16.0, 0.0, 0.0, 8.0, 1.0]


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe", "tiny-hybrid", "tiny-gpt-mtp"])
def test_the_harness_sharpens_every_attention_layers_queries_and_keys_and_no_values(model):
    import torch

    from harness.runtime.model import MODELS, TinyLM
    from harness.stack.runtime import sharpen_queries_and_keys

    c = MODELS[model]
    m = TinyLM(c)
    D = c.hidden // c.heads
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    assert sharpen_queries_and_keys(m, 4.0) == sum(k in "B*" for k in c.kinds) + c.mtp_depth
    for n, p in m.named_parameters():
        if n.endswith("qkv.weight"):
            q, k, v = p.detach().split([c.heads * D, c.kv_heads * D, c.kv_heads * D])
            q0, k0, v0 = before[n].split([c.heads * D, c.kv_heads * D, c.kv_heads * D])
            assert torch.equal(q, 4 * q0) and torch.equal(k, 4 * k0) and torch.equal(v, v0), n
        else:
            assert torch.equal(p, before[n]), n


def test_the_separate_gathers_bug_is_torchs_gloo_all_gather_backward_scrambling_a_strided_gradient():
    """``docs/repro/gloo_all_gather_backward.py``: on gloo, ``torch.distributed.nn.functional.all_gather``'s backward
    scatters the incoming gradient into buffers with its strides, and gloo's scatter fills them in storage order, so
    a non-contiguous gradient comes back scrambled (a contiguous one exact). The worked example's
    ``separate-kv-gathers`` bug fails ``verify`` on CPU ranks through this defect: its key gathers receive
    non-contiguous gradients, the stacked K/V gather a contiguous one. When torch fixes it, this test fails and the
    bug needs another form."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    r = subprocess.run([sys.executable, str(ROOT / "docs/repro/gloo_all_gather_backward.py")], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "REPRO_PORT": port})
    assert r.returncode == 0, r.stderr[-2000:]
    got = {m[0]: float(m[1]) for m in re.findall(r"rank 0: (.+?): max \|.*?\| = (\S+)", r.stdout)}
    assert got["all_gather backward, contiguous gradient"] == 0, r.stdout
    assert got["all_gather backward, transposed gradient"] > 1 and got["dist.scatter into a transposed output"] > 0, \
        f"torch's gloo all_gather backward no longer scrambles a strided gradient:\n{r.stdout}"
    assert got["dist.all_to_all_single into a transposed output"] > 0, f"gloo's all_to_all_single now honours a " \
        f"strided output: drop it from docs/upstream-findings.md's report\n{r.stdout}"
