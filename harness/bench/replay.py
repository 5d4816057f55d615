"""``dcp-harness bench replay``: a recorded ``bench step`` report's batches, scheduled again and priced by its cost.

A step report holds everything its schedules came from: the workload (``config``: lengths, seed, global batch,
``max_seqlen_per_rank``, the arms), the world and the cost its calibration measured. ``replay`` regenerates every
measured batch of every run, schedules it with each arm as the installed code does now and prices each schedule with
the simulator under that run's calibrated cost:

- a ``bench step --stack megatron-core`` report: arms static CP, megatron-core's own scheduler, ``balanced`` (packed
  by the batch's tokens: megatron-core runs each sequence as its own pass), the stack's calibration, the synchronous
  model megatron-core's group barriers make;
- a ``bench step`` report (the harness's runtime): its arms (``layout:scheduler[:padding[:execution]]``), each run's
  calibrated cost model, each arm's execution model.

It prints per batch each arm's predicted step (and micro-batches) beside the batch's lower bound, per arm the
predicted median against the measured one, and per pair of arms the predicted ratio (totals over the batches)
against the measured one (the median over runs of the per-run ratios): whether the model ranks the arms as the GPUs
did, and what a scheduler change does on the same batches before it spends GPU time. Absolute times are the model's;
the ratios are what it is for.

The megatron-core scheduler's arm needs megatron-core importable (the CPU machine's 0.16.1 gives the same schedules
as the GPU machine's 0.19.2 on the recorded batches: the replay of the 2026-11-27 default-workload report reproduces
every measured step's CP-size counts).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from harness.plan import PlanInputError

STACK_ARMS = ("static", "megatron-core", "balanced")


class ReplayInputError(PlanInputError):
    """A report ``replay`` cannot read (exit 2); the message names the file and the fix."""


def load_report(path) -> dict:
    """A ``bench step`` or ``bench step --stack megatron-core`` report with its calibration."""
    from harness.io import read_report

    p = Path(path)
    d = read_report(p, ("step", "step_megatron_core"), ReplayInputError,
                    "a 'dcp-harness bench step' report of either stack (replay reads its config and calibration)")
    if d["benchmark"] == "step_megatron_core" and not d["results"].get("calibration"):
        raise ReplayInputError(f"{p} has no calibration (run without --no-calibrate or --cost-model): replay prices "
                               f"the schedules with the stack's calibrated cost")
    if d["benchmark"] == "step" and not all(isinstance(r, dict) and r.get("cost_model")
                                            for r in d["results"].get("runs") or [None]):
        raise ReplayInputError(f"{p}: a run has no cost model (results.runs[].cost_model); rerun bench step to write it")
    return d


def replay(report: dict, arms=None) -> dict:
    """Every measured batch of ``report`` scheduled by ``arms`` (default: the report's) and simulated under its
    calibrated cost (module doc)."""
    stack = report["benchmark"] == "step_megatron_core"
    known = STACK_ARMS if stack else tuple(report["config"]["arms"])
    arms = tuple(arms or known)
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ReplayInputError(f"unknown arm(s) {unknown}; this report's arms are {', '.join(known)}")
    batches, measured = (_stack if stack else _runtime)(report, arms)
    per_arm = {a: {"predicted_ms": statistics.median(b["arms"][a]["ms"] for b in batches),
                   "measured_ms": statistics.median(m[a] for m in measured) if measured else None,
                   "of_bound": statistics.median(b["arms"][a]["ms"] / b["bound_ms"] for b in batches)} for a in arms}
    ratios = {}
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            ratios[f"{b} vs {a}"] = {
                "predicted": sum(x["arms"][a]["ms"] for x in batches) / sum(x["arms"][b]["ms"] for x in batches),
                "measured": statistics.median(m[a] / m[b] for m in measured) if measured else None}
    world = report["results"]["gpus"] if stack else report["results"]["world"]
    return {"stack": "megatron-core" if stack else "harness", "world": int(world),
            "measured_at": (report.get("producer") or {}).get("git_rev"), "batches": batches, "arms": per_arm,
            "ratios": ratios}


def measured_ms(value, where: str) -> float:
    """A measured step time from a report: a finite number > 0, else ``ReplayInputError`` naming where it is (a NaN
    or inf would otherwise pass silently into every ratio and fit)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ReplayInputError(f"{where} is {value!r}, not a finite step time > 0 ms: the report is damaged; rerun "
                               f"bench step to write it")
    return float(value)


def _sizes(s) -> dict[int, int]:
    out: dict[int, int] = {}
    for mb in s.layout:
        for b in mb:
            out[b.size] = out.get(b.size, 0) + len(b.gids)
    return dict(sorted(out.items()))


def _priced(bound: float, run: int, step: int, lengths, arms_ms: dict) -> dict:
    return {"run": run, "step": step, "sequences": len(lengths), "arms": arms_ms, "bound_ms": bound * 1e3}


def _stack(report: dict, arms) -> tuple[list[dict], list[dict]]:
    """megatron-core's report: (batches priced, measured per-run step medians per arm)."""
    from harness.bench.stack_calibrate import stack_cost
    from harness.bench.stack_step import _schedule
    from harness.bench.step.config import StepBenchConfig
    from harness.bench.step.workload import global_batch_lengths, model_cost
    from harness.plan import lower_bound, simulate

    cfg = StepBenchConfig.from_dict(dict(report["config"]))
    world = int(report["results"]["gpus"])
    cost = stack_cost(model_cost(cfg), report["results"]["calibration"], None)
    steps, batches = cfg.warmup + cfg.iters, []
    for run in range(cfg.runs):
        for i in range(cfg.warmup, steps):
            lengths, _ = global_batch_lengths(cfg, world, run * steps + i)
            got = {}
            for arm in arms:
                s, _, _ = _schedule(arm, lengths, world, cfg.max_seqlen_per_rank, cost)
                got[arm] = {"ms": simulate(s, cost, execution="synchronous").step_time * 1e3,
                            "microbatches": s.num_microbatches, "sequences_by_cp": _sizes(s)}
            bound = lower_bound(lengths, n_ranks=world, max_seqlen_per_rank=cfg.max_seqlen_per_rank, cost=cost,
                                execution="synchronous", microbatch_tokens_per_rank=sum(lengths))
            batches.append(_priced(bound, run + 1, i + 1, lengths, got))
    measured = [{a: measured_ms(r[a]["median_ms"], f"results.per_run[{k}].{a}.median_ms") for a in arms}
                for k, r in enumerate(report["results"].get("per_run", [])) if all(a in r for a in arms)]
    return batches, measured


def _runtime(report: dict, arms) -> tuple[list[dict], list[dict]]:
    """The harness runtime's report: (batches priced per run's cost, measured per-run trimmed means per arm)."""
    from harness.bench.step.config import StepBenchConfig, arm_cost, cost_model_from, parse_arm
    from harness.bench.step.workload import global_batch_lengths
    from harness.plan import lower_bound, simulate
    from harness.plan.execution import resolve_execution
    from harness.train.layouts import LayoutConfig, plan

    cfg = StepBenchConfig.from_dict(dict(report["config"]))
    world = int(report["results"]["world"])
    parsed = {a: parse_arm(a) for a in arms}
    kinds = {resolve_execution(p.execution).kind for p in parsed.values()}
    bound_ex = kinds.pop() if len(kinds) == 1 else "independent"
    batches = []
    for run, r in enumerate(report["results"]["runs"]):
        cost = cost_model_from(r["cost_model"])
        for i in range(cfg.warmup, cfg.warmup + cfg.iters):
            lengths, _ = global_batch_lengths(cfg, world, i)
            got = {}
            for a, arm in parsed.items():
                lcfg = LayoutConfig(n_ranks=world, max_seqlen_per_rank=cfg.max_seqlen_per_rank,
                                    static_cp=cfg.static_cp or world, scheduler=arm.scheduler, dcp_padding=arm.padding,
                                    execution=arm.execution, expert_parallel=cfg.expert_parallel)
                s, _, _ = plan(arm.layout, lengths, lcfg, arm_cost(cfg, arm, cost))  # as it ran
                got[a] = {"ms": simulate(s, cost).step_time * 1e3, "microbatches": s.num_microbatches,
                          "sequences_by_cp": _sizes(s)}
            bound = lower_bound(lengths, n_ranks=world, max_seqlen_per_rank=cfg.max_seqlen_per_rank, cost=cost,
                                execution=bound_ex)
            batches.append(_priced(bound, run + 1, i + 1, lengths, got))
    measured = [{a: measured_ms(r["arms"][a]["trimmed_mean_ms"], f"results.runs[{k}].arms.{a}.trimmed_mean_ms")
                 for a in arms} for k, r in enumerate(report["results"]["runs"]) if all(a in r.get("arms", {}) for a in arms)]
    return batches, measured


def console(result: dict, name: str = "") -> str:
    from harness.report.text import aligned

    arms = list(result["arms"])
    rows = [[str(b["run"]), str(b["step"]), str(b["sequences"])]
            + [f"{b['arms'][a]['ms']:.1f} ({b['arms'][a]['microbatches']})" for a in arms] + [f"{b['bound_ms']:.1f}"]
            for b in result["batches"]]
    out = [f"replay of {name or 'the report'} ({result['stack']}'s step): {len(result['batches'])} batches on "
           f"{result['world']} ranks, predicted step ms (micro-batches) under the calibrated cost",
           aligned(["run", "step", "sequences", *arms, "lower bound"], rows), ""]
    out.append(aligned(["arm", "predicted ms (median)", "measured ms (median of runs)", "of the bound (median)"],
                       [[a, f"{v['predicted_ms']:.1f}", "-" if v["measured_ms"] is None else f"{v['measured_ms']:.1f}",
                         f"{v['of_bound']:.3f}"] for a, v in result["arms"].items()]))
    for k, v in result["ratios"].items():
        m = "-" if v["measured"] is None else f"{v['measured']:.3f}"
        out.append(f"  {k}: predicted {v['predicted']:.3f}x (total over the batches), measured {m}x (median of runs)")
    out.append(f"  (predicted: today's schedulers; measured: those of the report's code, {result['measured_at'] or '?'})")
    return "\n".join(out)
