"""``dcp-harness bench replay``: a recorded ``bench step --stack megatron-core`` report's batches, scheduled again.

A stack report holds everything its schedules came from: the workload (``config``: lengths, seed, global batch,
``max_seqlen_per_rank``), the world and the cost its calibration measured (``results.calibration``). ``replay``
regenerates every measured batch of every run, schedules it with each arm as the installed code does now (static
CP, megatron-core's own scheduler, ``balanced`` with the stack's capacity) and prices each schedule with the
simulator under the calibrated cost and the synchronous model megatron-core's group barriers make. It prints, per
arm, the predicted median step against the measured one and, per pair of arms, the predicted ratio against the
measured ratio: whether the model ranks the arms as the GPUs did, and what a scheduler change would do on the same
batches before it spends GPU time. The prediction is a model's (its absolute times are the calibration's, 2-3x the
measured steps when the calibration's count fit is steep); the ratios are what it is for.

Needs megatron-core importable for its scheduler's arm (the CPU machine's 0.16.1 gives the same schedules as the
GPU machine's 0.19.2 on the recorded batches: the replay of the 2026-11-27 default-workload report reproduces every
measured step's CP-size counts).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from harness.plan import PlanInputError

ARMS = ("static", "megatron-core", "balanced")
PAIRS = {("static", "megatron-core"): "megatron-core dynamic CP vs static CP", ("static", "balanced"): "balanced vs static CP",
         ("megatron-core", "balanced"): "balanced vs megatron-core's scheduler"}
"""(slower arm, faster arm) -> the report's name of their measured ratio (``harness.bench.stack_step``)."""


class ReplayInputError(PlanInputError):
    """A report ``replay`` cannot read (exit 2); the message names the file and the fix."""


def load_report(path) -> dict:
    from harness.io import read_report

    p = Path(path)
    d = read_report(p, ("step_megatron_core",), ReplayInputError,
                    "a 'dcp-harness bench step --stack megatron-core' report (replay reads the stack's reports: they "
                    "hold the calibration)")
    if not d["results"].get("calibration"):
        raise ReplayInputError(f"{p} has no calibration (run without --no-calibrate or --cost-model): replay prices "
                               f"the schedules with the stack's calibrated cost")
    return d


def replay(report: dict, arms=ARMS) -> dict:
    """Every measured batch of ``report`` scheduled by ``arms`` and simulated under its calibrated cost (module doc)."""
    from harness.bench.stack_calibrate import stack_cost
    from harness.bench.stack_step import _schedule
    from harness.bench.step.config import StepBenchConfig
    from harness.bench.step.workload import global_batch_lengths, model_cost
    from harness.plan import lower_bound, simulate

    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ReplayInputError(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    cfg = StepBenchConfig.from_dict(dict(report["config"]))
    world = int(report["results"]["gpus"])
    cost = stack_cost(model_cost(cfg), report["results"]["calibration"], None)
    steps = cfg.warmup + cfg.iters
    batches = []
    for run in range(cfg.runs):
        for i in range(cfg.warmup, steps):
            lengths, _ = global_batch_lengths(cfg, world, run * steps + i)
            row = {"run": run + 1, "step": i + 1, "sequences": len(lengths), "arms": {}}
            for arm in arms:
                s, _, _ = _schedule(arm, lengths, world, cfg.max_seqlen_per_rank, cost)
                sizes: dict[int, int] = {}
                for mb in s.layout:
                    for b in mb:
                        sizes[b.size] = sizes.get(b.size, 0) + len(b.gids)
                row["arms"][arm] = {"ms": simulate(s, cost, execution="synchronous").step_time * 1e3,
                                    "microbatches": s.num_microbatches, "sequences_by_cp": dict(sorted(sizes.items()))}
            row["bound_ms"] = lower_bound(lengths, n_ranks=world, max_seqlen_per_rank=cfg.max_seqlen_per_rank, cost=cost,
                                          execution="synchronous", microbatch_tokens_per_rank=sum(lengths)) * 1e3
            batches.append(row)
    measured = report["results"].get("arms", {})
    per_arm = {a: {"predicted_ms": statistics.median(b["arms"][a]["ms"] for b in batches),
                   "measured_ms": (measured.get(a) or {}).get("median_ms"),
                   "of_bound": statistics.median(b["arms"][a]["ms"] / b["bound_ms"] for b in batches)} for a in arms}
    ratios = {}
    for (a, b), name in PAIRS.items():
        if a in arms and b in arms:
            key = f"{b} vs {a}"
            got = (report["results"].get("ratios") or {}).get(name)
            ratios[key] = {"predicted": sum(x["arms"][a]["ms"] for x in batches) / sum(x["arms"][b]["ms"] for x in batches),
                           "measured": (got or {}).get("median")}
    return {"world": world, "measured_at": (report.get("producer") or {}).get("git_rev"),
            "calibration": report["results"]["calibration"], "batches": batches, "arms": per_arm, "ratios": ratios}


def console(result: dict, name: str = "") -> str:
    from harness.report.text import aligned

    arms = list(result["arms"])
    rows = [[str(b["run"]), str(b["step"]), str(b["sequences"])]
            + [f"{b['arms'][a]['ms']:.0f} ({b['arms'][a]['microbatches']})" for a in arms] + [f"{b['bound_ms']:.0f}"]
            for b in result["batches"]]
    out = [f"replay of {name or 'the report'}: {len(result['batches'])} batches on {result['world']} ranks, predicted step ms "
           f"(micro-batches) under the calibrated cost, synchronous model",
           aligned(["run", "step", "sequences", *arms, "lower bound"], rows), ""]
    out.append(aligned(["arm", "predicted ms (median)", "measured ms (median of runs)", "of the bound (median)"],
                       [[a, f"{v['predicted_ms']:.1f}", "-" if v["measured_ms"] is None else f"{v['measured_ms']:.1f}",
                         f"{v['of_bound']:.3f}"] for a, v in result["arms"].items()]))
    for k, v in result["ratios"].items():
        m = "-" if v["measured"] is None else f"{v['measured']:.3f}"
        out.append(f"  {k}: predicted {v['predicted']:.3f}x (total over the batches), measured {m}x (median of runs)")
    out.append(f"  (predicted: today's schedulers; measured: those of the report's code, {result['measured_at'] or '?'})")
    return "\n".join(out)
