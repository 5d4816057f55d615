"""A measured step that compiles is named and fails ``bench step``'s check, instead of being averaged in.

The compiled chain compiles at its first call and again at its first new shape (Dynamo's automatic dynamic shapes):
with one warm-up step, the first measured step times the compiler (seconds where the step takes tens of ms).
"""

from __future__ import annotations

import torch

from harness.bench import step
from harness.bench.compiles import compile_events, compiled_line
from harness.bench.step.cli import COMPILED_SMOKE_WARMUP, resolve_config
from harness.bench.step.summarise import compiled_steps, steady_check
from harness.jobs.launch import run_on_ranks
from harness.report.step_report import render


def test_compile_events_count_the_first_compile_and_the_recompile_at_a_new_shape():
    torch._dynamo.reset()
    w = torch.randn(8, 8, requires_grad=True)
    f = torch.compile(lambda x: (x @ w).relu().sum(), backend="aot_eager")
    seen = []
    for rows in (3, 4, 5, 5):
        before = compile_events()
        f(torch.randn(rows, 8)).backward()
        seen.append(compile_events() - before)
    assert seen[0] > 0 and seen[1] > 0, seen  # the first call, then the shape-generic recompile
    assert seen[2:] == [0, 0], seen  # a third shape and a repeated one reuse the generic graph
    before = compile_events()
    (torch.randn(4, 8) @ w).sum().backward()  # eager work moves nothing
    assert compile_events() == before


def _summary(per_run: list[dict]) -> dict:
    return {"runs": [{"arms": arms} for arms in per_run]}


def test_the_steady_check_fails_for_a_compiled_measured_step_and_names_the_arm():
    clean = _summary([{"thd:dp-balanced": {"compiles": [0, 0, 0]}, "dcp:balanced": {"compiles": [0, 0, 0]}}])
    c = steady_check(clean)
    assert c["pass"] is True and c["value"] == 0 and c["shown"] == "0 of 6 steps compiled"
    dirty = _summary([{"thd:dp-balanced": {"compiles": [0, 0, 0]}, "dcp:balanced": {"compiles": [0, 0, 0]}},
                      {"thd:dp-balanced": {"compiles": [0, 0, 0]}, "dcp:balanced": {"compiles": [0, 7, 0]}}])
    c = steady_check(dirty)
    assert c["pass"] is False and c["value"] == 1 and c["shown"] == "1 of 12 steps compiled"
    assert c["target"].endswith(": dcp:balanced 1 of 6") and "thd:dp-balanced" not in c["target"]
    assert compiled_steps(dirty)["dcp:balanced"] == [0, 0, 0, 0, 7, 0]  # the runs' steps in order
    line = compiled_line("dcp:balanced", compiled_steps(dirty)["dcp:balanced"], 1)
    assert "1 of 6 measured steps compiled (step 5; 7 compile events)" in line and "--warmup (now 1" in line
    assert compiled_line("thd:dp-balanced", [0, 0], 1) is None
    # a report from before the count has no such check (``bench rejudge`` re-judges those)
    assert steady_check(_summary([{"dcp:balanced": {"step_ms": [1.0]}}])) is None


def test_a_compiling_smoke_warms_up_past_the_recompile_unless_told_otherwise():
    assert resolve_config({}, cpu=True, cuda=False).warmup == step.CPU_SMOKE["warmup"] == 1  # eager: one is enough
    compiled = resolve_config({"compile": "aot_eager-chain"}, cpu=True, cuda=False)
    assert compiled.warmup == COMPILED_SMOKE_WARMUP == 2
    assert resolve_config({"compile": "aot_eager-chain", "warmup": 1}, cpu=True, cuda=False).warmup == 1
    assert resolve_config({}, cpu=False, cuda=True).warmup == step.StepBenchConfig().warmup  # GPUs: the default


def _measure(rank, world, cfg):
    return step.measure(rank, world, cfg)


def test_a_compiled_chain_with_one_warm_up_step_compiles_in_its_first_measured_step(tmp_path):
    """2 gloo ranks, the chain compiled by ``aot_eager``, one warm-up step: the first measured step recompiles
    (every rank reports the most any rank compiled), the second does not, and the report's check fails naming
    the arm."""
    cfg = {**step.CPU_SMOKE, "warmup": 1, "iters": 2, "profile_iters": 0, "microbatches": 4, "calibrate": False,
           "compile": "aot_eager-chain", "arms": ("dcp:balanced",), "device": "cpu"}
    ranks = run_on_ranks(_measure, world_size=2, tmp_path=tmp_path, args=(cfg,), timeout_s=240)
    for r in ranks:
        got = r["runs"][0]["arms"]["dcp:balanced"]["compiles"]
        assert got[0] > 0 and got[1] == 0, (r["rank"], got)
    bench = step.StepBenchConfig.from_dict(cfg)
    s = step.summarize({"world": 2, "ranks": ranks}, bench)
    cks = step.checks(s, "cpu")
    c = [c for c in cks if c["target"].startswith("no measured step compiled")]
    assert len(c) == 1 and c[0]["pass"] is False and "dcp:balanced 1 of 2" in c[0]["target"]
    # no target applies on a CPU, but the page fails: its figures time the compiler
    page = render(s, bench, cks, 2)
    assert '<span class="verdict fail">FAIL</span>' in page and "1 of 2 steps compiled" in page
