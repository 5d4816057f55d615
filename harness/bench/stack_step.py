"""``dcp-harness bench step --stack megatron-core``: Megatron's dynamic-CP benchmark on megatron-core + TE itself.

The same workload as ``bench step`` (``StepBenchConfig``: the 12-layer GPT of hidden 2048, lognormal lengths of mean
1024, sigma 1.5, at most 8192; ``--global-batch`` tokens / megatron / sequences:K) trained by megatron-core's own
step (``harness.stack.megatron_core``: ``GPTModel`` with the TE spec, ``hybrid_context_parallel_forward_backward``,
TE's THD CP attention; the stack's workarounds of the upstream defects in force), in three arms that differ only in
the schedule each global batch is given:

- ``static``: every sequence at CP = the world (Megatron's static-CP baseline: one sequence per sample);
- ``megatron-core``: megatron-core's own ``BalancedCPScheduler`` (``harness.upstream.megatron``; its hybrid CP);
- ``balanced``: the harness's scheduler, fed to the same megatron-core step.

Each run trains every arm (interleaved: run 1 static, megatron-core, balanced; run 2 ...) for ``warmup`` + ``iters``
steps on the same global batches; a step is timed from a barrier to the slowest rank's end (max over ranks). Per
arm: the median step of each run, the median over runs; speedups are ratios of the arms' times in the same run,
their median over runs. MFU: the model's FLOPs of the real tokens (no padding, causal attention, no recompute) /
step time / GPUs / the device's dense bf16 peak. With ``profile_iters`` > 0 (the default) the last run profiles one
more step per arm: where rank 0's wall time went (``harness.bench.trace``: attention, linear, other, exposed
communication, idle - no kernel running, the host-bound gaps). Before its runs the job measures the stack's cost
per sequence and rank and its FLOP rate (``harness.bench.stack_calibrate``) for ``balanced``'s cost model, unless
``--no-calibrate`` or ``--cost-model``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from harness.bench import host
from harness.bench.compiles import compile_events, compiled_line
from harness.bench.host import describe as describe_hosts
from harness.bench.stack_calibrate import (
    calibration_batches,
    calibration_line,
    calibration_time,
    fit_stack_cost,
    stack_cost,
)
from harness.bench.step.config import StepBenchConfig, cost_model_from
from harness.bench.step.summarise import compiled_steps, steady_check
from harness.bench.step.workload import global_batch_lengths, model_cost, model_flops, peak_tflops
from harness.jobs.entry import register
from harness.runtime.model_config import MODELS

ARMS = ("static", "megatron-core", "balanced")
MARK = "dcp_harness_stack_step"
JOB = register("bench-stack-step", "harness.bench.stack_step:measure")


def _schedule(arm: str, lengths: list[int], world: int, mslpr: int, cost):
    from harness.train.layouts import LayoutConfig, for_stack, plan  # lazy: imports torch

    if arm == "static":
        lcfg = LayoutConfig(n_ranks=world, max_seqlen_per_rank=mslpr, static_cp=world)
        return plan("thd", lengths, lcfg, cost)
    # megatron-core's step ends every group with a barrier of the DP x CP domain (MegatronCoreStack.execution) and runs
    # each sequence of a group as its own forward and backward (.sequence_passes): planned as verify plans it
    lcfg = LayoutConfig(n_ranks=world, max_seqlen_per_rank=mslpr, static_cp=world, scheduler=arm)
    return plan("dcp", lengths, for_stack(lcfg, lengths, sequence_passes=True, execution="synchronous"), cost)


def measure(rank: int, world: int, cfg_dict: dict) -> dict:
    """Every arm's step times on this rank (the torchrun job's entry)."""
    import torch
    import torch.distributed as dist

    from harness.heartbeat import Heartbeat
    from harness.stack.megatron_core import MegatronCoreStack
    from harness.stack.protocol import StackContext, StepRequest

    beat = Heartbeat.from_cfg(cfg_dict, rank)
    beat.beat(force=True, phase="building megatron-core's model")
    cfg = StepBenchConfig.from_dict(cfg_dict)
    m = MODELS[cfg.model]
    ctx = StackContext(rank=rank, world=world, device="cuda", dtype="bfloat16", vocab=m.vocab)
    stack = MegatronCoreStack(ctx, workarounds=cfg_dict.get("workarounds", "all"), layers=m.layers, hidden=m.hidden,
                              heads=m.heads, kv_heads=m.kv_heads, lr=cfg.lr, ffn=m.ffn,
                              **cfg_dict.get("stack_options", {}))
    stack.build(cfg.seed)
    cost = cost_model_from(cfg.cost_model) if cfg.cost_model else model_cost(cfg)
    steps = cfg.warmup + cfg.iters
    dev = torch.device("cuda")
    out = {"rank": rank, "device": torch.cuda.get_device_name(0), "runs": [], "calibration": None,
           "host": host.probe(dev)}  # before the steps (``harness.bench.host``)
    if cfg.calibrate and cfg.cost_model is None and "balanced" in cfg_dict["stack_arms"]:
        times = {}  # every rank's are the slowest rank's: the fit and the schedules agree on every rank
        for name, lengths in calibration_batches(world, cfg.max_seqlen_per_rank).items():
            beat.beat(force=True, phase=f"calibrating the stack's cost ({name})")
            times[name] = calibration_time(stack, lengths, world, cfg, m.vocab, dev)
        out["calibration"] = fit_stack_cost(times, model_cost(cfg, comm=False), cfg.max_seqlen_per_rank)
        cost = stack_cost(cost, out["calibration"], peak_tflops(cfg, out["device"]))
        if rank == 0:
            print(calibration_line(out["calibration"]), flush=True)
    for run in range(cfg.runs):
        per_arm = {}
        for arm in cfg_dict["stack_arms"]:
            times, flops, sizes, compiles = [], [], {}, []
            for i in range(steps):
                beat.beat(run=run + 1, arm=arm, step=i + 1, of=steps)
                lengths, _ = global_batch_lengths(cfg, world, run * steps + i)
                rng = np.random.default_rng(cfg.seed * 1000003 + run * steps + i)
                batch = [rng.integers(0, m.vocab, size=L + 1) for L in lengths]
                sched, padding, fixed = _schedule(arm, lengths, world, cfg.max_seqlen_per_rank, cost)
                req = StepRequest(step=i, layout="dcp", batch=batch, schedule=sched, padding=padding,
                                  fixed_length=fixed, want=frozenset())
                torch.cuda.synchronize()
                dist.barrier()
                compiled = compile_events()
                t0 = time.perf_counter()
                stack.step(req)
                torch.cuda.synchronize()
                took = torch.tensor([time.perf_counter() - t0, compile_events() - compiled], device=dev,
                                    dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's time, the most any rank compiled
                if i >= cfg.warmup:
                    times.append(float(took[0]))
                    compiles.append(int(took[1]))
                    flops.append(model_flops(lengths, model_cost(cfg, comm=False)))
                    for mb in sched.layout:
                        for b in mb:
                            sizes[b.size] = sizes.get(b.size, 0) + len(b.gids)
            per_arm[arm] = {"ms": [t * 1e3 for t in times], "flops": flops, "sequences_by_cp": sizes,
                            "compiles": compiles}
            if run == cfg.runs - 1 and cfg.profile_iters:  # the last run profiles one more step of the arm
                beat.beat(run=run + 1, arm=arm, phase="profiled step")
                keep = (f"{cfg.trace_dir}/trace_{arm}_rank0.json.gz" if cfg.trace_dir and rank == 0 else None)
                per_arm[arm]["breakdown"] = profile_call(lambda: stack.step(req), dev, keep)
            if rank == 0:
                print(f"run {run + 1} {arm}: median {statistics.median(times) * 1e3:.1f} ms over {len(times)} steps",
                      flush=True)
        out["runs"].append(per_arm)
    stack.close()
    return out


def profile_call(fn, device, keep: str | None = None) -> dict:
    """``fn()`` once under ``torch.profiler`` (after a barrier, synchronised): where its wall time went
    (``harness.bench.trace.breakdown``: attention, linear, other, exposed communication, idle; kernels on CUDA, host
    operators on CPU). ``keep``: also write the Chrome trace there, gzipped (for Perfetto)."""
    import os
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from harness.bench.trace import annotations, breakdown, load_trace

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if dist.is_initialized():
        dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof, record_function(MARK):
        fn()
        if cuda:
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="dcp_stack_step_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        trace = load_trace(path)
        if keep:
            import gzip
            from pathlib import Path

            from harness.io import atomic_write_bytes

            Path(keep).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(keep, gzip.compress(Path(path).read_bytes(), mtime=0))
    finally:
        os.unlink(path)
    windows = annotations(trace, MARK)
    if not windows:
        raise RuntimeError(f"the profiler trace has no {MARK} annotation")
    return breakdown(trace, windows[-1])


def summarize(res: dict, cfg: StepBenchConfig, world: int, arms: list[str]) -> dict:
    """Medians per arm and run, ratios per run and their medians, MFU (see the module doc)."""
    r0 = res["ranks"][0]
    peak = peak_tflops(cfg, r0["device"])
    per_run = []
    for run in r0["runs"]:
        row = {}
        for arm, v in run.items():
            med = statistics.median(v["ms"])
            tflops = statistics.median(f / (t / 1e3) / 1e12 for f, t in zip(v["flops"], v["ms"])) / world
            row[arm] = {"median_ms": med, "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
                        "sequences_by_cp": v["sequences_by_cp"], "compiles": v.get("compiles")}
        per_run.append(row)
    hosts = [r.get("host") for r in res["ranks"]]
    out = {"device": r0["device"], "gpus": world, "arms": {}, "ratios": {}, "per_run": per_run,
           "calibration": r0.get("calibration"), "hosts": hosts, "host_line": describe_hosts(hosts)}
    for arm in arms:
        out["arms"][arm] = {k: statistics.median(r[arm][k] for r in per_run) if per_run[0][arm][k] is not None else None
                            for k in ("median_ms", "tflops_per_gpu", "mfu")}
        out["arms"][arm]["sequences_by_cp"] = per_run[0][arm]["sequences_by_cp"]
        last = r0["runs"][-1][arm].get("breakdown")  # rank 0's profiled step of the last run
        out["arms"][arm]["breakdown"] = last
    pairs = {"megatron-core dynamic CP vs static CP": ("static", "megatron-core"),
             "balanced vs static CP": ("static", "balanced"),
             "balanced vs megatron-core's scheduler": ("megatron-core", "balanced")}
    for name, (slow, fast) in pairs.items():
        if slow in arms and fast in arms:
            each = [r[slow]["median_ms"] / r[fast]["median_ms"] for r in per_run]
            out["ratios"][name] = {"median": statistics.median(each), "per_run": each}
    out["checks"] = [c for c in [steady_check({"runs": [{"arms": row} for row in per_run]})] if c]
    return out


def main(*, nproc: int | None, out, overrides: dict, stall_s: float | None, arms: list[str] | None = None,
         workarounds: str = "all", stack_options: dict | None = None) -> int:
    """Run the job on ``nproc`` GPUs (default min(4, GPUs)), print the arms and ratios, write the JSON."""
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    import torch

    from harness.bench.common import REPORTS, table, write_report
    from harness.bench.step.config import BenchConfigError
    from harness.bench.trace import kernel_lines
    from harness.jobs.entry import launch
    from harness.stack.megatron_core import preflight

    n = nproc or min(4, torch.cuda.device_count())
    preflight("cuda", n, "bench step --stack megatron-core")
    arms = list(arms or ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise BenchConfigError(f"unknown arm {unknown[0]!r} of bench step --stack megatron-core; choose from "
                               f"{', '.join(ARMS)}")
    cfg = StepBenchConfig.from_dict({**overrides, "device": "cuda"})
    cfg.validate(n)
    out = Path(out or REPORTS / "bench_step_megatron_core.json")
    if cfg.trace_dir == "":
        cfg = replace(cfg, trace_dir=str(out.parent / f"{out.stem}_traces"))
    print(f"bench step --stack megatron-core: {n} x {torch.cuda.get_device_name(0)}, model {cfg.model}, "
          f"{cfg.global_batch} global batches, arms {', '.join(arms)}, {cfg.runs} runs of {cfg.warmup} + {cfg.iters} "
          f"steps (workarounds {workarounds}{''.join(f', {k}={v}' for k, v in (stack_options or {}).items())})",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = launch(JOB, n, Path(tmp) / "stack_step.json",
                     {**cfg.to_dict(), "arms": list(cfg.arms), "stack_arms": arms, "workarounds": workarounds,
                      "stack_options": stack_options or {}},
                     stall_s=stall_s, stream=lambda line: print(line, flush=True))
    if res is None:
        return 0
    summary = summarize(res, cfg, n, arms)
    if summary["host_line"]:
        print(f"bench step: {summary['host_line']}", flush=True)
    rows = [{"arm": a, **v} for a, v in summary["arms"].items()]
    print(table(rows, [("arm", "arm", "s"), ("median_ms", "step ms (median of runs)", ".1f"),
                       ("tflops_per_gpu", "TFLOP/s per GPU", ".1f"), ("mfu", "MFU", ".3f")]))
    for name, r in summary["ratios"].items():
        print(f"  {name}: {r['median']:.3f}x (runs: {', '.join(f'{x:.3f}' for x in r['per_run'])})")
    if summary.get("calibration"):
        print(f"  balanced's cost model: {calibration_line(summary['calibration'])}")
    parts = [{"arm": a, **v["breakdown"]} for a, v in summary["arms"].items() if v.get("breakdown")]
    if parts:
        print("one profiled step of the last run (rank 0, ms; idle: no kernel running - host-bound gaps):")
        print(table(parts, [("arm", "arm", "s"), ("wall", "wall", ".1f"), ("attention", "attention", ".1f"),
                            ("linear", "linear", ".1f"), ("other", "other", ".1f"),
                            ("communication", "comm (exposed)", ".1f"), ("idle", "idle", ".1f"),
                            ("host_syncs", "host syncs", ".0f"), ("host_sync_ms", "sync ms", ".1f")]))
        for line in kernel_lines({a: v.get("breakdown") for a, v in summary["arms"].items()}):
            print(line)
    for arm, compiled in compiled_steps({"runs": [{"arms": row} for row in summary["per_run"]]}).items():
        line = compiled_line(arm, compiled, cfg.warmup)
        if line:
            print(line)
    for c in summary["checks"]:
        print(f"  [{'PASS' if c['pass'] else 'FAIL'}] {c['target']}: {c['shown']}")
    path = write_report("step_megatron_core", {**cfg.to_dict(), "gpus": n, "stack_arms": arms,
                                               "workarounds": workarounds, "stack_options": stack_options or {}},
                        summary, out=out, checks=summary["checks"])
    print(f"wrote {path}" + (f"\nrank 0's profiled steps (Chrome traces, for Perfetto): {cfg.trace_dir}"
                             if cfg.profile_iters else ""))
    return 0 if all(c["pass"] for c in summary["checks"]) else 1
