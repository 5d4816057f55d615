"""``dcp-harness run``: the main job on the embedded CPU default.

1. Convergence: bshd vs THD packing vs dynamic CP, tiny GPT, 4 gloo ranks, 50 steps, fp32; every
   layout within 1e-5 of bshd and of the committed golden at every step (``harness.apps.converge``); and
   the same under pipeline parallelism (2 stages of 2 ranks) against its PP = 1 golden, with the
   pipeline timeline of one step; and the hybrid model (Mamba-style SSM mixers, attention and MLP
   layers, 2 gloo ranks) against its golden.
2. Scheduler comparison (``bench schedule`` on a quick grid) and a rank-by-rank picture of one batch.
3. The edge-case catalogue (spec 2.8 and the differential suite's findings).
4. The fault catalogue (``harness.faults``): every re-created integration bug must be caught by its
   check, and no check may fire on the clean runs ("faults caught: N/N").
Writes ``reports/run-<timestamp>/`` (``index.html``, ``summary.md``, ``results.json``, and
``convergence/`` with the metrics JSONL and offline wandb runs) into a temporary folder renamed at the
end, so an interrupted run leaves earlier reports intact, and prints a PASS / FAIL verdict.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
from pathlib import Path

from harness.apps import converge
from harness.bench import schedule as bench_schedule
from harness.data.edge_cases import run_all
from harness.data.workloads import sample
from harness.faults.run import run_catalogue
from harness.faults.run import verdict as fault_verdict
from harness.golden import producer
from harness.io import atomic_write_json, atomic_write_text, temporary_folder
from harness.paths import REPORTS
from harness.plan import gpt_benchmark_cost, schedule, simulate
from harness.report.html import figure_png
from harness.train.config import TrainConfig

TIMELINE = ("wikipedia", 32, 256, 0)  # distribution, ranks, sequences, seed


def _timeline() -> dict:
    # lazy: imports matplotlib; only the report needs it
    from harness.report import plots

    dist, n, num, seed = TIMELINE
    spec, mslpr = bench_schedule.DISTRIBUTIONS[dist]
    gpt = gpt_benchmark_cost()
    lengths = sample(spec, num, seed)
    scheds = {a: schedule(lengths, n_ranks=n, max_seqlen_per_rank=mslpr, algorithm=a, cost=gpt)
              for a in ("balanced", "megatron-dev", "megatron-pr2000", "dp-balanced")}
    steps = {a: simulate(s, gpt).step_time for a, s in scheds.items()}
    return {"title": f"{dist}, {n} ranks, {num} sequences (seed {seed}), GPT cost",
            "img": figure_png(plots.timelines(scheds, gpt, steps)), "step_times": steps}


DEFAULT_CONVERGENCE = {"model": "tiny-gpt", "steps": 50, "world": 4, "micro_batch_size": 4}
"""bshd in micro-batches of 4 padded sequences, as Megatron's pretraining path runs it: the padding is the layout's
point, not the number of passes (one sequence a pass would run 32 passes a step for the same tokens)."""
DEFAULT_PIPELINE = {"model": "tiny-gpt", "steps": 50, "world": 4, "pp": 2, "max_seqlen_per_rank": 512,
                    "micro_batch_size": 4}
"""Two pipeline stages of a 2-rank DP x CP domain; its golden is the PP = 1 case on 2 ranks."""
DEFAULT_HYBRID = {"model": "tiny-hybrid", "steps": 50, "world": 2, "max_seqlen_per_rank": 512}
"""SSM mixer, attention, SSM mixer, MLP ("M*M-") on a 2-rank domain: the mixers' all-to-all runs in
every CP block dynamic CP forms."""
CASES = (("convergence", "convergence", ""), ("pipeline", "convergence under pipeline parallelism",
                                                "pipeline {pp} stages: "),
         ("hybrid", "convergence of the hybrid SSM model", "hybrid model: "))
"""(result key, progress title, check label) of the main job's convergence cases, in run order."""


def _converge(spec: dict, default: dict, run_dir: Path, out_root: Path, stall_s, what: str, references: dict):
    c = dict(spec)
    world = c.pop("world")
    pipe = f", {c['pp']} pipeline stages" if c.get("pp", 1) > 1 else ""
    print(f"{what}: {c['model']}, {world} gloo ranks{pipe}, {c['steps']} steps, layouts bshd / thd / dcp")
    golden = "require" if spec == default else "auto"  # the defaults have committed goldens
    return converge.run(TrainConfig(**c), world=world, golden=golden, run_dir=run_dir,
                        progress=lambda s: print(s, flush=True), out_root=out_root, stall_s=stall_s,
                        references=references)


def run(*, quick_batches: int = 3, out_root: Path | str = REPORTS, convergence: dict | None = DEFAULT_CONVERGENCE,
        pipeline: dict | None = DEFAULT_PIPELINE, hybrid: dict | None = DEFAULT_HYBRID, faults: bool = True,
        stall_s: float | None = None) -> tuple[int, Path]:
    t0 = time.perf_counter()
    print("dcp-harness run: convergence (one stage, a pipeline, the hybrid SSM model), scheduler comparison, edge "
          "cases and the fault catalogue on the embedded CPU default")
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(".run-", out_root)
    try:
        specs = {"convergence": (convergence, DEFAULT_CONVERGENCE), "pipeline": (pipeline, DEFAULT_PIPELINE),
                 "hybrid": (hybrid, DEFAULT_HYBRID)}
        runs, references = {}, {}  # the one-stage and pipeline cases share their reference (one rank, no PP)
        for i, (key, title, _) in enumerate(CASES, 1):
            spec, default = specs[key]
            runs[key] = _converge(spec, default, tmp / key, out_root, stall_s, f"[{i}/{STEPS}] {title}",
                                  references) if spec else None
        return _rest(t0, quick_batches, tmp, out_root, runs, faults)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


STEPS = len(CASES) + 4


def _rest(t0, quick_batches, tmp, out_root, runs, with_faults=True):
    n = len(CASES)
    print(f"[{n + 1}/{STEPS}] scheduler comparison ({quick_batches} global batches per configuration)")
    bench = bench_schedule.run(quick=True, batches=quick_batches, progress=lambda s: print(s, flush=True))
    print(f"[{n + 2}/{STEPS}] edge cases (spec 2.8 and the differential suite's findings)")
    edges = run_all()
    for e in edges:
        ours_ok = all(o["ok"] for o in e["ours"].values())
        up = e["upstream"]
        print(f"  {e['key']:20s} harness {'OK  ' if ours_ok else 'FAIL'}  megatron-core: "
              f"{'not installed' if up is None else up['kind']}")
    faults = None
    if with_faults:
        print(f"[{n + 3}/{STEPS}] fault catalogue: clean runs, then every re-created bug with its seam replaced")
        faults = run_catalogue(progress=lambda s: print(s, flush=True))
    print(f"[{STEPS}/{STEPS}] report")
    timeline = _timeline()
    checks = []
    for key, _, label in CASES:
        if runs.get(key) is not None:
            label = label.format(pp=runs[key].config.get("pp"))
            checks += [{**c, "target": label + c["target"]} for c in runs[key].checks]
            v = runs[key].verdict  # NO REFERENCE / NOT EXERCISED show as such, never as PASS
            checks.append({"target": f"{label}verdict of {runs[key].case_id}", "value": v == "PASS", "shown": v,
                           "pass": v == "PASS"})
    checks += [c for c in bench["checks"] if "latency" not in c["target"]]
    checks += [{"target": f"edge case {e['key']}: typed error or valid schedule from every algorithm",
                "value": sum(o["ok"] for o in e["ours"].values()),
                "shown": f"{sum(o['ok'] for o in e['ours'].values())}/{len(e['ours'])}",
                "pass": all(o["ok"] for o in e["ours"].values())}
               for e in edges]
    if faults is not None:
        checks.append({"target": "fault catalogue: every re-created bug caught by its check, no alarm on the clean "
                                 "runs", "value": faults["caught"],
                       "shown": f"faults caught: {faults['caught']}/{faults['total']}", "pass": fault_verdict(faults)})
    verdict = "PASS" if all(c["pass"] for c in checks) else "FAIL"
    result = {"verdict": verdict, "checks": checks + [c for c in bench["checks"] if "latency" in c["target"]],
              "bench": bench, "edge_cases": edges, "faults": faults, "timeline": timeline,
              **{key: runs.get(key) for key, _, _ in CASES},
              "producer": producer("dcp-harness run"), "finished": dt.datetime.now().isoformat(timespec="seconds")}
    path = _write(result, tmp, out_root)
    print(f"\nreport: {path / 'index.html'}\nsummary: {path / 'summary.md'}")
    print(f"verdict: {verdict} ({sum(c['pass'] for c in checks)}/{len(checks)} checks, {time.perf_counter() - t0:.0f} s)")
    return (0 if verdict == "PASS" else 1), path


def _write(result: dict, tmp: Path, out_root: Path) -> Path:
    # lazy: imports matplotlib; only the report needs it
    from harness.report.schedule_report import render

    html, md = render(result)
    atomic_write_text(tmp / "index.html", html)
    atomic_write_text(tmp / "summary.md", md)

    def brief(c):
        return None if c is None else {"verdict": c.verdict, "case_id": c.case_id, "checks": c.checks,
                                       "config": c.config}

    cases = [key for key, _, _ in CASES]
    atomic_write_json(tmp / "results.json",
                      {k: v for k, v in result.items() if k not in ("timeline", *cases)}
                      | {"timeline": {k: v for k, v in result["timeline"].items() if k != "img"}}
                      | {key: brief(result.get(key)) for key in cases})
    final = out_root / f"run-{dt.datetime.now():%Y%m%d-%H%M%S}"
    if final.exists():
        final = final.with_name(final.name + f"-{os.getpid()}")
    os.replace(tmp, final)
    return final
