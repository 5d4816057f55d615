"""``dcp-harness bench step``'s driver: resolve the config, run the torchrun job, print the tables
and verdicts, write ``bench_step.json`` and its HTML report.

The only module of the package that runs processes and writes files; the statistics it prints come
from ``summarise`` and the table definitions from ``harness.report.step_tables`` (shared with the
HTML report, which imports nothing of the benchmark).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from harness.bench.common import REPORTS, table, write_report
from harness.bench.compiles import compiled_line
from harness.bench.host_lead import lead_line, pass_line
from harness.bench.step.config import BenchConfigError, StepBenchConfig
from harness.bench.step.summarise import TARGETS, checks, compiled_steps, summarize
from harness.bench.trace import device_only_line, kernel_lines, rank_line
from harness.io import atomic_write_text
from harness.jobs.entry import launch, register
from harness.jobs.nodes import Nodes
from harness.report.step_report import render
from harness.report.step_tables import (
    BREAKDOWN_COLUMNS,
    COLUMNS,
    PHASE_COLUMNS,
    arm_rows,
    arrival_line,
    breakdown_rows,
    phase_rows,
    run_columns,
    runs_rows,
    saved_columns,
    saved_rows,
)

CPU_SMOKE = {"model": "tiny-gpt", "lengths": "lognormal:mean=96,sigma=1.2,min=8,max=512", "max_seqlen_per_rank": 128,
             "warmup": 1, "iters": 3, "profile_iters": 1, "dtype": "float32", "calibration_reps": 1,
             "calibration_burst": 2, "runs": 1}
"""``--cpu``: a smoke configuration on gloo (checks the pipeline end to end; no targets)."""
COMPILED_SMOKE_WARMUP = 2
"""The smoke's warm-up steps when it compiles (``--cpu --compile ...`` without ``--warmup``): a compiled model compiles
again at its first new shape, so one warm-up step leaves that compile in the first measured step
(``harness.bench.compiles``)."""

def resolve_config(overrides: dict | None, *, cpu: bool, cuda: bool) -> StepBenchConfig:
    """The run's configuration: the defaults (``CPU_SMOKE`` with ``cpu``), then the options the user gave; a compiling
    smoke warms up ``COMPILED_SMOKE_WARMUP`` steps unless ``--warmup`` was given."""
    cfg = StepBenchConfig.from_dict({**(CPU_SMOKE if cpu else {}), **(overrides or {}),
                                     "device": "cuda" if cuda else "cpu"})
    if cpu and cfg.compile_backend() and "warmup" not in (overrides or {}):
        cfg = replace(cfg, warmup=COMPILED_SMOKE_WARMUP)
    return cfg


JOB = register("bench-step", "harness.bench.step.job:measure")
"""The torchrun job of ``bench step``: every rank runs ``harness.bench.step.job.measure``."""


def _progress(line: str) -> None:
    if not line.startswith(("USDT:", "STAGE:")):  # libkineto prints these on every profiler start/stop
        print(line, flush=True)


def main(*, nproc: int | None = None, out: Path | None = None, html: Path | None = None, cpu: bool = False,
         overrides: dict | None = None, stall_s: float | None = None, nodes: Nodes | None = None) -> int:
    """``nproc``: processes on this machine; ``nodes``: this machine of a multi-node job (the world is
    ``nproc x nnodes``; node 0 writes the report)."""
    cuda = False
    if not cpu:
        import torch  # lazy: a --cpu run's launching process needs no torch (its ranks import it)

        cuda = torch.cuda.is_available()
    if not cuda and not cpu:
        print("dcp-harness bench step: needs CUDA GPUs; --cpu runs a smoke configuration on gloo", file=sys.stderr,
              flush=True)
        return 2
    cfg = resolve_config(overrides, cpu=cpu, cuda=cuda)
    n = nproc or (min(4, torch.cuda.device_count()) if cuda else 2)
    if cuda and n > torch.cuda.device_count():
        raise BenchConfigError(f"--nproc {n} needs {n} GPUs but {torch.cuda.device_count()} are visible; "
                               f"use --nproc <= {torch.cuda.device_count()}")
    nodes = nodes or Nodes()
    world = n * nodes.nnodes
    cfg.validate(world)
    out = out or REPORTS / "bench_step.json"
    html = html or out.with_suffix(".html")
    if cfg.trace_dir == "":
        cfg = replace(cfg, trace_dir=str(out.parent / f"{out.stem}_traces"))
    where = torch.cuda.get_device_name(0) if cuda else "CPU (gloo)"
    print(f"bench step: {n} x {where}{f' on {nodes.describe()} ({world} ranks)' if nodes.multi else ''}, "
          f"model {cfg.model}, {cfg.dtype}, "
          f"blocks {'compiled (' + cfg.compile_label() + ')' if cfg.compile_label() else 'eager'}"
          f"{f', token bucket {cfg.bucket()}' if cfg.bucket() else ''}, gradient all-reduce {cfg.grad_reduce}, "
          f"{cfg.optimizer} optimizer, arms {', '.join(cfg.arms)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_json = {**cfg.to_dict(), "arms": list(cfg.arms)}
        res = launch(JOB, n, Path(tmp) / "step.json", cfg_json, stream=_progress, stall_s=stall_s,
                     log=out.parent / "logs" / f"bench-step-{time.strftime('%Y%m%d-%H%M%S')}.log", nodes=nodes)
    if res is None:  # a node other than node 0 (or a rank other than 0 of a world the user's launcher started)
        print(f"{nodes.describe()}: its ranks finished; rank 0 writes the report", flush=True)
        return 0
    summary = summarize(res, cfg)
    if summary["host_line"]:
        print(f"bench step: {summary['host_line']}", flush=True)
    _print_tables(summary, cfg)
    cks = checks(summary, "cuda" if cuda else "cpu")
    _print_verdicts(summary, cks, cfg.warmup)
    path = write_report("step", {**cfg.to_dict(), "gpus": world, "nodes": nodes.nnodes,
                                  "numa_binding": nodes.numa_binding}, summary, out=out, checks=cks)
    atomic_write_text(html, render(summary, cfg, cks, world))
    print(f"wrote {path}\nwrote {html}")
    return 0 if all(c["pass"] is not False for c in cks) else 1


def _print_tables(summary: dict, cfg: StepBenchConfig) -> None:
    """The per-run table (several runs), the representative run's arms, its breakdown and phases."""
    if len(summary["runs"]) > 1:
        print(f"per run (trimmed-mean ms; ratios > 1: {TARGETS['ours']} faster):")
        print(table(runs_rows(summary), run_columns(summary)))
        print(f"run {summary['representative_run'] + 1} (the median speedup) in detail:")
    print(table(arm_rows(summary), COLUMNS))
    brows = breakdown_rows(summary)
    if brows:
        run_note = (f" of run {summary['breakdown_run'] + 1}, the last: only it profiles"
                    if len(summary["runs"]) > 1 and summary.get("breakdown_run") is not None else "")
        print(f"breakdown of one step (ms, mean over ranks and {cfg.profile_iters} profiled steps{run_note}):")
        print(table(brows, BREAKDOWN_COLUMNS))
        for line in kernel_lines({k: v.get("breakdown") for k, v in summary["arms"].items()}):
            print(line)
        for k, v in summary["arms"].items():
            line = rank_line(k, v.get("breakdown_per_rank") or [])
            if line:
                print(line)
        for k, v in summary["arms"].items():
            if v.get("breakdown_device"):
                print(device_only_line(k, v["breakdown_device"]))
        saved = saved_rows(summary)
        if saved:
            print("where each arm's speedup comes from (ms static CP spends more than the arm, per part of a profiled "
                  "step; negative: the arm spends more):")
            print(table(saved, saved_columns(saved)))
    for k, v in summary["arms"].items():
        for line in (lead_line(k, v.get("host_lead_per_rank") or []), pass_line(k, v.get("host_lead_per_rank") or [])):
            if line:
                print(line)
    for k, v in summary["arms"].items():
        if v["breakdown_error"]:
            print(f"  {k}: no breakdown: {v['breakdown_error']}")
    if phase_rows(summary):
        print(f"step phases (trimmed-mean ms of the measured steps, each boundary when the slowest rank passed it; "
              f"gradient all-reduce {cfg.grad_reduce}, {cfg.optimizer} optimizer):")
        print(table(phase_rows(summary), PHASE_COLUMNS))
        for k, v in summary["arms"].items():
            line = arrival_line(k, v)
            if line:
                print(line)


def _print_verdicts(summary: dict, cks: list[dict], warmup: int) -> None:
    """The modelled speedup bound (context) and each target's verdict."""
    bound = summary["ratios"]["speedup_bound"]
    if bound["median"] is not None:
        print(f"  speedup bound under the calibrated cost model (static's modelled time / the lower bound of any "
              f"schedule): median {bound['median']:.3f} (runs: {', '.join(f'{x:.3f}' for x in bound['per_run'])})")
        share = summary["ratios"].get("speedup_of_bound") or {}
        if share.get("median") is not None:
            each = ", ".join("-" if x is None else f"{x:.3f}" for x in share["per_run"])
            print(f"  measured speedup / that bound: median {share['median']:.3f} (runs: {each})")
    for label, r in summary.get("cost_ab", {}).items():
        each = ", ".join("-" if x is None else f"{x:.3f}" for x in r["per_run"])
        print(f"  cost models side by side: {r['base']} / {label} time ratio (> 1: {label} faster), median over runs: "
              f"{r['median']:.3f} (runs: {each})")
    for label, r in summary.get("weights_ab", {}).items():
        each = ", ".join("-" if x is None else f"{x:.3f}" for x in r["per_run"])
        print(f"  weight copies side by side: {label} / {r['base']} time ratio (> 1: the step's weight copies "
              f"faster), median over runs: {r['median']:.3f} (runs: {each})")
    for label, r in summary.get("bucket_ab", {}).items():
        each = ", ".join("-" if x is None else f"{x:.3f}" for x in r["per_run"])
        print(f"  token buckets side by side: {r['base']} / {label} time ratio (> 1: {label} faster, padding "
              f"included), median over runs: {r['median']:.3f} (runs: {each})")
    for label, compiled in compiled_steps(summary).items():
        line = compiled_line(label, compiled, warmup)
        if line:
            print(line)
    for c in cks:
        verdict = "n/a (targets apply to 4 GPUs)" if c["pass"] is None else ("PASS" if c["pass"] else "FAIL")
        each = f" (runs: {', '.join(f'{x:.3f}' for x in c['per_run'])})" if c["runs"] > 1 and c["per_run"] else ""
        print(f"  [{verdict}] {c['target']}: {c.get('shown') or format(c['value'], '.3f')}{each}")

