"""``bench step``'s statistics and targets: the job's per-rank JSON -> per-run arm figures, the
target ratios over runs and their verdicts.

Pure Python over the job's result (no torch, no world), so the statistics are tested on made-up
results and a report can be redrawn from a ``bench_step.json``.
"""

from __future__ import annotations

import math
import re
import statistics

from harness.bench.host import describe as describe_hosts
from harness.bench.step.config import PHASES, StepBenchConfig
from harness.bench.step.workload import model_cost, model_flops, peak_tflops
from harness.bench.trace import mean_breakdown
from harness.finite import within

TARGETS = {"speedup_vs_static": {"tokens": 1.4, "megatron": 1.2}, "world": 4, "ours": "dcp:balanced",
           "upstream": "dcp:megatron-dev", "baseline": "thd:dp-balanced"}
"""The speedup over static CP is a target per global batch (``StepBenchConfig.global_batch``): 1.4x on the default
workload, 1.2x on Megatron's batch; the curve's ``sequences:K`` batches have none (their ratio is reported, not judged)."""



def trimmed_mean(xs: list[float], trim: float) -> float:
    """Mean after dropping ``floor(trim * n)`` values from each end (scipy's ``trim_mean``)."""
    if not xs:
        raise ValueError("no values")
    s, k = sorted(xs), math.floor(trim * len(xs))
    kept = s[k:len(s) - k] or s
    return statistics.fmean(kept)


def paired_ratio(num: list[float], den: list[float], trim: float) -> float:
    """How much longer the arm ``num`` took than the arm ``den`` over the same measured steps (> 1: ``den`` is
    faster): ``sum(num) / sum(den)`` - the ratio of their throughputs on the same global batches - after dropping the
    ``floor(trim * n)`` steps with the lowest and as many with the highest per-step ratio ``num[i] / den[i]``.

    The arms run the same global batch in each measured step (interleaved), and batches differ in cost (on Megatron's
    batch of 8 lognormal sequences, by up to 3x from step to step). A trimmed mean of each arm's own times drops each
    arm's heaviest steps - the batches with the longest sequences, where the choice of CP sizes matters most - so its
    ratio judges a lighter population of batches than training runs. Trimming on the per-step *ratio* drops what
    happened to one arm only (a host hiccup, a collection) and keeps every batch's weight in the sum."""
    if len(num) != len(den):
        raise ValueError(f"the arms measured different numbers of steps ({len(num)} and {len(den)}): a paired "
                         "ratio needs the same steps")
    if not num:
        raise ValueError("no steps")
    bad = [x for x in (*num, *den) if not (math.isfinite(x) and x > 0)]
    if bad:
        raise ValueError(f"step times must be positive and finite, got {bad[:3]}")
    if not 0 <= trim < 0.5:  # also refuses NaN
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
    k = math.floor(trim * len(num))
    order = sorted(range(len(num)), key=lambda i: (num[i] / den[i], i))
    kept = order[k:len(order) - k] or order
    return math.fsum(num[i] for i in kept) / math.fsum(den[i] for i in kept)


def summarize(result: dict, cfg: StepBenchConfig) -> dict:
    """Statistics from the job's JSON (rank 0 holds the slowest-rank times). ``runs``: one summary
    per run (``_summarize_run``); ``ratios``: each target ratio per run and its median (what the
    targets judge); ``arms``, ``cost_model`` and ``calibration`` at the top level are the
    *representative* run's: the one whose speedup of ours over the baseline is the median (the
    lower median for an even count; the last run if the ratio cannot be formed), except the
    ``BREAKDOWN_FIELDS``, which come from the profiled run (``breakdown_run``: the last, or None)."""
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    r0, world = ranks[0], result["world"]
    hosts = [r.get("host") for r in ranks]  # each rank's probe (None in jobs from before it)
    runs = [_summarize_run(ranks, k, world, cfg) for k in range(len(r0["runs"]))]
    ratios = target_ratios(runs, cfg.trim)
    rep = _representative(ratios["speedup_vs_static"]["per_run"])
    top = dict(runs[rep])
    profiled = next((k for k in range(len(runs) - 1, -1, -1)
                     if any(a["breakdown"] or a["breakdown_error"] for a in runs[k]["arms"].values())), None)
    if profiled is not None and profiled != rep:  # the breakdown comes from the profiled (last) run
        top["arms"] = {label: {**a, **{f: runs[profiled]["arms"][label][f] for f in BREAKDOWN_FIELDS}}
                       for label, a in runs[rep]["arms"].items()}
    return {**top, "runs": runs, "representative_run": rep, "breakdown_run": profiled, "ratios": ratios,
            "cost_ab": cost_ab(runs, cfg.trim), "weights_ab": weights_ab(runs, cfg.trim),
            "bucket_ab": bucket_ab(runs, cfg.trim), "world": world,
            "device_name": r0["device_name"], "hosts": hosts, "host_line": describe_hosts(hosts),
            "peak_tflops": peak_tflops(cfg, r0["device_name"]),
            "parameters": r0["parameters"], "torch": r0["torch"], "compile": r0.get("compile"),
            "global_batch": _global_batch(r0["batches"], cfg, world)}


def target_ratios(runs: list[dict], trim: float) -> dict:
    """Each of ``RATIOS`` per run, with its median, min and max over the runs that could form it."""
    ratios = {name: {"per_run": [f(run["arms"], trim) for run in runs]} for name, f in RATIOS.items()}
    for r in ratios.values():
        vals = [v for v in r["per_run"] if v is not None]
        r["median"] = statistics.median(vals) if vals else None
        r["min"], r["max"] = (min(vals), max(vals)) if vals else (None, None)
    return ratios


def _twins(runs: list[dict], base_of, ratio) -> dict:
    """``{label: {"base", "per_run", "median"}}`` for each arm whose label ``base_of`` maps to a twin arm's (None:
    no twin), ``ratio(twin's figures, its figures)`` per run where both ran, and its median over those runs."""
    out = {}
    for label in (runs[0]["arms"] if runs else {}):
        base = base_of(label)
        if base is None:
            continue
        per_run = [ratio(run["arms"][base], run["arms"][label]) if base in run["arms"] and label in run["arms"]
                   else None for run in runs]
        vals = [v for v in per_run if v is not None]
        if vals:
            out[label] = {"base": base, "per_run": per_run, "median": statistics.median(vals)}
    return out


def _time(base: dict, arm: dict, trim: float) -> float:
    """time(base) / time(arm) over the same steps (``paired_ratio``)."""
    return paired_ratio(base["step_ms"], arm["step_ms"], trim)


def cost_ab(runs: list[dict], trim: float) -> dict:
    """Each arm that names a cost model (``dcp:balanced~NAME``) against the same arm on the run's model, when both
    ran: the ratio time(base) / time(label) per run (> 1: the named model's schedules were faster) and its median
    over the runs - the A/B of two cost models side by side."""
    return _twins(runs, lambda label: label.split("~", 1)[0] if "~" in label else None,
                  lambda base, arm: _time(base, arm, trim))


def weights_ab(runs: list[dict], trim: float) -> dict:
    """Each arm that takes its weights per call (``dcp:balanced%per-call``) against the same arm with the step's
    weight copies (``harness.runtime.weight_cache``), when both ran: the ratio time(label) / time(base) per run
    (> 1: the copies made the step faster) and its median."""
    return _twins(runs, lambda label: label.replace("%per-call", "", 1) if "%per-call" in label else None,
                  lambda base, arm: _time(arm, base, trim))


def bucket_ab(runs: list[dict], trim: float) -> dict:
    """Each arm with its own token bucket (``dcp:balanced#64``) against the same arm without one, when both ran: the
    ratio time(base) / time(label) per run (> 1: the labelled arm's bucket made its step faster, padding included;
    ``#0`` beside a config-wide bucket is the same A/B the other way round) and its median."""
    return _twins(runs, lambda label: re.sub(r"#\d+", "", label, count=1) if "#" in label else None,
                  lambda base, arm: _time(base, arm, trim))


def _representative(ours: list[float | None]) -> int:
    """The run whose speedup ``ours`` is the median (the lower one for an even count; ties to the
    earlier run), or the last run when some run has no speedup."""
    if all(v is not None for v in ours):
        order = sorted(range(len(ours)), key=lambda k: (ours[k], k))
        return order[(len(order) - 1) // 2]
    return len(ours) - 1


def _global_batch(batches: list[dict], cfg: StepBenchConfig, world: int) -> dict:
    """How big the measured global batches were (``StepBenchConfig.global_batch``)."""
    tokens = [float(sum(b["lengths"])) for b in batches]
    return {"mode": cfg.global_batch, "sequences": cfg.batch_sequences(world),
            "sequences_mean": statistics.fmean(len(b["lengths"]) for b in batches),
            "tokens_mean": statistics.fmean(tokens), "longest": max(max(b["lengths"]) for b in batches),
            "clipped": sum(b["clipped"] for b in batches)}


def _ratio(num: str, den: str, paired: bool = True):
    """time(num) / time(den) of a run's arms over the same steps (``paired_ratio``; ``paired=False``: the ratio of
    each arm's own trimmed mean), None when either arm is missing."""
    def f(arms: dict, trim: float):
        a, b = arms.get(TARGETS[num]), arms.get(TARGETS[den])
        if not (a and b):
            return None
        return _time(a, b, trim) if paired else a["trimmed_mean_ms"] / b["trimmed_mean_ms"]
    return f


def _speedup_bound(arms: dict, _trim: float | None = None):
    """The baseline's modelled step time over the lower bound of *any* schedule of the same batches
    (``harness.plan.bounds.lower_bound``), both under the run's calibrated cost model: the speedup
    no scheduler can beat on this machine's measured costs (a relaxation: it may be unreachable)."""
    a, b = arms.get(TARGETS["baseline"]), arms.get(TARGETS["ours"])
    return a["predicted"] / b["lower_bound"] if a and b and b["lower_bound"] else None


def _of_bound(arms: dict, trim: float):
    """The measured speedup over static CP as a share of ``_speedup_bound`` (1.0: as fast as the model allows any
    schedule to be; above 1 when the model over-prices what the schedule does)."""
    s, b = _ratio("baseline", "ours")(arms, trim), _speedup_bound(arms)
    return s / b if s and b else None


RATIOS = {"speedup_vs_static": _ratio("baseline", "ours"), "ours_vs_upstream": _ratio("upstream", "ours"),
          "speedup_bound": _speedup_bound, "speedup_of_bound": _of_bound,
          "trimmed_speedup_vs_static": _ratio("baseline", "ours", paired=False)}
"""The targets' ratios of the arms' times over the same steps (``paired_ratio``; > 1: ours is faster); the modelled
bound on the first and the first's share of it (neither a target: they say how much room the measured costs leave any
scheduler, and how much of it the schedule took; a target set against one bound can move out of reach when the
baseline gets faster: the share says whether the schedule or the room changed); and the first as the ratio of each
arm's own trimmed mean, the statistic before the paired one (reported beside it, not judged; ``paired_ratio`` says
why)."""


BREAKDOWN_FIELDS = ("breakdown", "breakdown_per_rank", "compute_imbalance_ms", "breakdown_error", "breakdown_device")
"""An arm's figures from the profiled steps (only the last run profiles)."""


def _summarize_run(ranks: list[dict], k: int, world: int, cfg: StepBenchConfig) -> dict:
    """Run ``k``'s arms (``_arm_summary``), each with its speedups over the baseline arm, and the
    run's cost model and calibration."""
    r0 = ranks[0]
    run0 = r0["runs"][k]
    cost = model_cost(cfg, comm=False)
    batches = {"flops": [model_flops(b["lengths"], cost) for b in r0["batches"]],
               "tokens": [float(sum(b["lengths"])) for b in r0["batches"]]}
    peak = peak_tflops(cfg, r0["device_name"])
    seconds = _in_seconds(run0)
    arms = {label: _arm_summary(a, [r["runs"][k]["arms"][label] for r in ranks], batches, world=world, peak=peak,
                                seconds=seconds, trim=cfg.trim)
            for label, a in run0["arms"].items()}
    base = arms.get(TARGETS["baseline"])
    for a in arms.values():
        a["speedup_vs_static"] = _time(base, a, cfg.trim) if base else None
        a["trimmed_speedup_vs_static"] = base["trimmed_mean_ms"] / a["trimmed_mean_ms"] if base else None
        a["predicted_speedup_vs_static"] = base["predicted"] / a["predicted"] if base and a["predicted"] else None
        a["microbatch_speedup_vs_static"] = (base["phases_ms"]["microbatches"] / a["phases_ms"]["microbatches"]
                                             if base and base["phases_ms"] and a["phases_ms"] else None)
    return {"arms": arms, "cost_model": run0.get("cost_model"), "calibration": run0.get("calibration")}


def _arm_summary(a: dict, mine: list[dict], batches: dict, *, world: int, peak: float | None, seconds: bool,
                 trim: float) -> dict:
    """One arm of one run: ``a`` is rank 0's record (slowest-rank times, schedules' figures),
    ``mine`` every rank's; ``batches`` the measured batches' model FLOPs and real tokens."""
    flops, tokens = batches["flops"], batches["tokens"]
    s = a["step_s"]
    tm = trimmed_mean(s, trim)
    per_iter_tflops = [f / t / world / 1e12 for f, t in zip(flops, s)]
    return {
        "trimmed_mean_ms": 1e3 * tm, "median_ms": 1e3 * statistics.median(s), "mean_ms": 1e3 * statistics.fmean(s),
        "min_ms": 1e3 * min(s), "max_ms": 1e3 * max(s), "stdev_ms": 1e3 * (statistics.stdev(s) if len(s) > 1 else 0.0),
        "step_ms": [1e3 * x for x in s],
        # compile events of each measured step, the most on any rank (None: a result from before they were counted)
        "compiles": a.get("compiles"),
        "tokens_per_s_per_gpu": statistics.fmean(tokens) / tm / world,
        "tflops_per_gpu": statistics.fmean(flops) / tm / world / 1e12,
        "mfu": (statistics.fmean(flops) / tm / world / (peak * 1e12)) if peak else None,
        "tflops_per_gpu_per_iter": per_iter_tflops,
        "padding_fraction": 1.0 - sum(tokens) / sum(a["processed_tokens"]),
        "microbatches": statistics.fmean(f["microbatches"] for f in a["schedules"]),
        "cp_histogram": _sum_hist(f["cp_histogram"] for f in a["schedules"]),
        "predicted": statistics.fmean(f["predicted"] for f in a["schedules"]),
        "predicted_ms": 1e3 * statistics.fmean(f["predicted"] for f in a["schedules"]) if seconds else None,
        "lower_bound": statistics.fmean(f["lower_bound"] for f in a["schedules"]),
        "plan_ms_median": statistics.median(a["plan_ms"]),
        "plan_wait_ms_median": statistics.median(a["plan_wait_ms"]) if a.get("plan_wait_ms") else None,
        "peak_memory_gb": max((m["peak_memory_gb"] or 0.0) for m in mine) or None,
        **_breakdown_summary(mine),
        "phases_ms": phase_times(a.get("phase_marks_ms"), trim),
        "arrival": arrival([m.get("own_phase_marks_ms") for m in mine], trim,
                           [f.get("rank_ends") for f in a["schedules"]], seconds),
        # each rank's lead over its GPU in the timed steps (CUDA only: None per rank elsewhere)
        "host_lead_per_rank": [m.get("host_lead") for m in mine],
    }


def _breakdown_summary(mine: list[dict]) -> dict:
    """The ``BREAKDOWN_FIELDS`` of one arm from every rank's profiled steps (None and an empty list
    when the run did not profile)."""
    parts = [p for m in mine for p in m["breakdown"]]
    per_rank = [mean_breakdown(m["breakdown"]) for m in mine if m["breakdown"]]
    compute = [sum(p[x] for x in ("attention", "linear", "other")) for p in per_rank]
    device = [p for m in mine for p in m.get("breakdown_device") or []]
    return {"breakdown": mean_breakdown(parts) if parts else None,
            "breakdown_device": mean_breakdown(device) if device else None,
            "breakdown_per_rank": per_rank,
            "compute_imbalance_ms": (max(compute) - statistics.fmean(compute)) if compute else None,
            "breakdown_error": next((m["breakdown_error"] for m in mine if m["breakdown_error"]), None)}


def phase_times(marks: list[list[float]] | None, trim: float) -> dict | None:
    """Trimmed-mean ms of each of ``PHASES`` from per-step phase boundaries (ms from the step's
    start when the slowest rank passed each boundary), and ``total``: their sum step by step. A
    phase's time is on the critical path: it includes waiting for the ranks still in the phase before."""
    if not marks:
        return None
    steps = [[b - a for a, b in zip([0.0] + m[:-1], m)] for m in marks]
    out = {name: trimmed_mean([st[k] for st in steps], trim) for k, name in enumerate(PHASES)}
    out["total"] = trimmed_mean([m[-1] for m in marks], trim)
    return out


def arrival(own_marks: list[list[list[float]] | None], trim: float, modelled: list[list[float] | None] | None = None,
            seconds: bool = False) -> dict | None:
    """When the ranks reached the gradient reduction, from each rank's own phase boundaries (``own_marks[r][step]``,
    ms from the step's start; the micro-batches' end is the second): ``spread_ms``, the trimmed mean over steps of
    how long the first rank to finish its micro-batches waited for the last (the time its all-reduce spins with no
    compute of its own: the part of the exposed all-reduce that balance, not bandwidth, decides), ``last_counts``,
    how many steps each rank was the last (one rank always last: a cost only it pays), ``lateness_ms``, each rank's
    mean ms after its step's mean end (a rank late on average by more than the spread's noise is a slow rank, not a
    slow schedule), and ``ends_ms``, each rank's end of micro-batches step by step.

    Beside them what the schedule's model expected (``modelled[step][r]``: each rank's modelled end, the cost model's
    units; in seconds when ``seconds``): ``modelled_spread_ms`` (None unless in seconds) and ``correlation``, Pearson's
    between each rank's measured and modelled deviation from its step's mean over every step (None when either does
    not vary). Near 1: the schedule's imbalance, which a better schedule or cost model removes; near 0: run-time
    variation the model does not see (host jitter, a slow rank); a model without one entry per step and rank is not
    compared. None when some rank has no marks (a result of an older version); ranks with different numbers of
    measured steps raise ``ValueError`` (their steps cannot be paired)."""
    if not own_marks or any(not m for m in own_marks):
        return None
    counts = [len(m) for m in own_marks]
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise ValueError(f"the ranks measured different numbers of steps ({per_rank}); every rank records every "
                         "measured step, so this result is corrupt")
    k = PHASES.index("microbatches")
    ends = [[m[k] for m in rank] for rank in own_marks]
    steps = list(zip(*ends))
    last = [0] * len(ends)
    for st in steps:
        last[max(range(len(st)), key=lambda r: (st[r], -r))] += 1
    lateness = [statistics.fmean(e - statistics.fmean(st) for e, st in zip(rank, steps)) for rank in ends]
    out = {"spread_ms": trimmed_mean([max(st) - min(st) for st in steps], trim), "last_counts": last, "ends_ms": ends,
           "lateness_ms": lateness, "modelled_spread_ms": None, "correlation": None}
    if modelled and len(modelled) == len(steps) and all(m and len(m) == len(ends) for m in modelled):
        if seconds:
            out["modelled_spread_ms"] = trimmed_mean([1e3 * (max(m) - min(m)) for m in modelled], trim)
        out["correlation"] = _deviation_correlation(steps, modelled)
    return out


def _deviation_correlation(measured: list, modelled: list) -> float | None:
    """Pearson's correlation of the per-step deviations from each step's mean (measured vs modelled), or None."""
    xs, ys = [], []
    for a, b in zip(measured, modelled):
        ma, mb = statistics.fmean(a), statistics.fmean(b)
        xs += [v - ma for v in a]
        ys += [v - mb for v in b]
    sx = math.sqrt(sum(v * v for v in xs))
    sy = math.sqrt(sum(v * v for v in ys))
    if sx == 0 or sy == 0:
        return None
    return sum(x * y for x, y in zip(xs, ys)) / (sx * sy)


def _in_seconds(run: dict) -> bool:
    """The cost model is in seconds: calibrated in this run, or a pinned calibrated one (``--cost-model``)."""
    return bool(run.get("calibration")) or str((run.get("cost_model") or {}).get("name", "")).startswith("calibrated")


def _sum_hist(hists) -> dict:
    out: dict[str, int] = {}
    for h in hists:
        for k, v in h.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


_WORKLOAD = {"tokens": "the default workload", "megatron": "Megatron's batch"}


def checks(summary: dict, device_type: str) -> list[dict]:
    """The issue's targets, judged on the median over runs of each ratio (``summary["ratios"]``);
    they apply to the 4-GPU run on GPUs (else reported as not applicable), the speedup's to the global batches
    it is set for (``TARGETS``). Each check carries the
    per-run values, so a report shows how close to the line the median is."""
    out, ratios = [], summary["ratios"]
    applies = device_type == "cuda" and summary["world"] == TARGETS["world"]
    runs = len(summary["runs"])
    what = "median over runs of the" if runs > 1 else "the"
    mode = summary.get("global_batch", {}).get("mode", "tokens")
    wanted = []
    speedup = TARGETS["speedup_vs_static"].get(mode)
    if speedup is not None:
        wanted.append(("speedup_vs_static", f"{TARGETS['ours']} / {TARGETS['baseline']}: {what} speedup "
                                            f">= {speedup} at {TARGETS['world']} GPUs ({_WORKLOAD[mode]})", speedup))
    wanted.append(("ours_vs_upstream", f"{TARGETS['ours']} at least as fast as {TARGETS['upstream']}: {what} time ratio "
                                       f"{TARGETS['upstream']} / {TARGETS['ours']} >= 1", 1.0))
    for name, target, threshold in wanted:
        v = ratios[name]["median"]
        if v is None:
            continue
        out.append({"target": target, "value": v, "per_run": ratios[name]["per_run"], "runs": runs,
                    "pass": within(v, threshold, ">=") if applies else None})
    steady = steady_check(summary)
    return out + ([steady] if steady else [])


def compiled_steps(summary: dict) -> dict[str, list[int]]:
    """Per arm, its measured steps' compile events over every run, in order (arms from results that predate the
    count are left out)."""
    out: dict[str, list[int]] = {}
    for run in summary["runs"]:
        for label, a in run["arms"].items():
            if a.get("compiles") is not None:
                out.setdefault(label, []).extend(a["compiles"])
    return out


def steady_check(summary: dict) -> dict | None:
    """"No measured step compiled": a step that compiles times the compiler (``harness.bench.compiles``), so every
    figure of its arm - means, ratios, MFU - is off. It applies everywhere (a smoke's too); None for a result without
    the count. ``value``: how many measured steps compiled, over every arm and run; ``validity``: it judges the
    measurement, not a target (a page with no target that applies still fails on it)."""
    per_arm = compiled_steps(summary)
    if not per_arm:
        return None
    bad = {label: sum(c > 0 for c in cs) for label, cs in per_arm.items()}
    n = sum(bad.values())
    where = ", ".join(f"{label} {k} of {len(per_arm[label])}" for label, k in bad.items() if k)
    return {"target": "no measured step compiled (the times are the step's, not the compiler's)"
                      + (f": {where}" if where else ""),
            "value": n, "shown": f"{n} of {sum(len(cs) for cs in per_arm.values())} steps compiled",
            "per_run": [], "runs": len(summary["runs"]), "pass": n == 0, "validity": True}
