"""``dcp-harness bench fit``: a cost model fitted to the whole measured steps of recorded ``bench step`` reports.

``bench step`` calibrates its cost model on isolated micro-batch shapes before it runs; ``bench replay`` shows that
model pricing static CP against megatron-dev within 0-7% of the measurement but crediting ``balanced``'s own plans
with 1-9% more than they get. ``fit`` instead prices every measured step of every arm of the given reports (the
harness runtime's; the schedules regenerated exactly as they ran, ``harness.bench.replay``) and chooses the cost
model's coefficients (``quadratic``, ``linear``, ``cp_comm``, ``per_microbatch``, ``cp_block``) plus one per-step
overhead that minimise the mean squared relative error of the simulated against the measured step time (a
deterministic Nelder-Mead over their logarithms, from the reports' own calibration).

With two reports or more it also holds each one out in turn, fits the rest, and prices the held-out report's arms:
the predicted ratio of every pair of arms under the fitted and under the calibrated model against the measured
one - the only evidence that the fit generalises. Caution: micro-batch counts grow with tokens, so the fit can
trade compute for per-micro-batch cost; it is validated on the schedules as they ran, not on the ones ``balanced``
would make with it. ``bench step --cost-model <out>`` schedules with the fitted model (the A/B that settles it).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np

from harness.bench.replay import ReplayInputError, load_report, measured_ms

FIELDS = ("quadratic", "linear", "cp_comm", "per_microbatch", "cp_block")
ITERATIONS = 300
"""Nelder-Mead iterations of a fit (each prices every step once)."""


def steps_of(report: dict, name: str) -> list[dict]:
    """Every measured step of a runtime report: its schedule as run, the run's calibrated cost and the measured ms."""
    from harness.bench.step.config import StepBenchConfig, arm_cost, cost_model_from, parse_arm
    from harness.bench.step.workload import global_batch_lengths
    from harness.train.layouts import LayoutConfig, plan

    if report["benchmark"] != "step":
        raise ReplayInputError(f"{name}: fit reads the harness runtime's 'bench step' reports (megatron-core's step "
                               f"is host-bound per sequence: its calibration is its model)")
    cfg = StepBenchConfig.from_dict(dict(report["config"]))
    world = int(report["results"]["world"])
    out = []
    for r, run in enumerate(report["results"]["runs"]):
        cost = cost_model_from(run["cost_model"])
        for label in cfg.arms:
            arm, measured = parse_arm(label), run["arms"][label]["step_ms"]
            if not isinstance(measured, list) or len(measured) != cfg.iters:
                raise ReplayInputError(f"{name}: results.runs[{r}].arms.{label}.step_ms holds "
                                       f"{len(measured) if isinstance(measured, list) else measured!r} step times, "
                                       f"not the {cfg.iters} measured steps of its config; rerun bench step")
            for j, i in enumerate(range(cfg.warmup, cfg.warmup + cfg.iters)):
                lengths, _ = global_batch_lengths(cfg, world, i)
                lcfg = LayoutConfig(n_ranks=world, max_seqlen_per_rank=cfg.max_seqlen_per_rank,
                                    static_cp=cfg.static_cp or world, scheduler=arm.scheduler,
                                    dcp_padding=arm.padding, execution=arm.execution,
                                    expert_parallel=cfg.expert_parallel)
                s, _, _ = plan(arm.layout, lengths, lcfg, arm_cost(cfg, arm, cost))  # as it ran
                ms = measured_ms(measured[j], f"{name}: results.runs[{r}].arms.{label}.step_ms[{j}]")
                out.append({"report": name, "arm": label, "schedule": s, "ms": ms, "cost": cost})
    return out


def _priced(x: np.ndarray, base):
    return replace(base, **{f: float(np.exp(v)) for f, v in zip(FIELDS, x[:-1])}), float(np.exp(x[-1]))


def _error(x: np.ndarray, steps: list[dict], base) -> float:
    from harness.plan import simulate

    cost, over = _priced(x, base)
    return float(np.mean([((simulate(s["schedule"], cost).step_time * 1e3 + over) / s["ms"] - 1.0) ** 2
                          for s in steps]))


def _nelder_mead(f, x0: np.ndarray, iterations: int, step: float = 0.3) -> tuple[np.ndarray, float]:
    """Deterministic Nelder-Mead (reflection 1, expansion 2, contraction and shrink 1/2)."""
    n = len(x0)
    pts = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iterations):
        order = np.argsort(vals, kind="stable")
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        centre = np.mean(pts[:-1], axis=0)
        xr = centre + (centre - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = centre + 2 * (centre - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centre + 0.5 * (pts[-1] - centre)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    best = int(np.argmin(vals))
    return pts[best], vals[best]


def fit_steps(steps: list[dict], iterations: int = ITERATIONS) -> dict:
    """The cost model (and per-step overhead, ms) of least mean squared relative step error over ``steps``."""
    base = steps[0]["cost"]
    start = [statistics.median(getattr(s["cost"], f) for s in steps) for f in FIELDS]
    x0 = np.log(np.array([max(v, 1e-12) for v in start] + [max(statistics.median(s["ms"] for s in steps) * 0.1, 1.0)]))
    x, err = _nelder_mead(lambda x: _error(x, steps, base), x0, iterations)
    cost, over = _priced(x, base)
    d = {f: float(f"{getattr(cost, f):.4g}") for f in FIELDS}
    d.update(constant=base.constant, per_sequence=base.per_sequence,
             name=f"fitted on {len(steps)} measured steps")
    return {"cost_model": d, "overhead_ms": over, "rms_relative_error": float(np.sqrt(err)), "steps": len(steps)}


def _ratios(steps: list[dict], cost=None, over: float = 0.0) -> dict:
    """Per pair of arms (in report order): the predicted ratio of their total step times (under ``cost``, or each
    step's own calibrated cost when None) and the measured one."""
    from harness.plan import simulate

    arms = list(dict.fromkeys(s["arm"] for s in steps))
    pred = {a: sum(simulate(s["schedule"], cost or s["cost"]).step_time * 1e3 + over for s in steps if s["arm"] == a)
            for a in arms}
    meas = {a: sum(s["ms"] for s in steps if s["arm"] == a) for a in arms}
    return {f"{b} vs {a}": {"predicted": pred[a] / pred[b], "measured": meas[a] / meas[b]}
            for i, a in enumerate(arms) for b in arms[i + 1:]}


def fit(paths, iterations: int = ITERATIONS, progress=None) -> dict:
    """``fit_steps`` over every step of the reports at ``paths``, and the leave-one-report-out validation;
    ``progress(text)`` (optional) hears of each fit as it starts (~7 s each for six reports on one core)."""
    say = progress or (lambda _text: None)
    from harness.bench.step.config import cost_model_from

    names = [str(p) for p in paths]
    if len(set(names)) != len(names):
        raise ReplayInputError(f"a report is given twice: {sorted(n for n in names if names.count(n) > 1)[0]}")
    reports = {n: load_report(p) for n, p in zip(names, paths)}
    per = {n: steps_of(r, n) for n, r in reports.items()}
    worlds = {int(r["results"]["world"]) for r in reports.values()}
    if len(worlds) != 1:
        raise ReplayInputError(f"the reports ran on different worlds ({sorted(worlds)} ranks); fit one world at a time")
    every = [s for n in names for s in per[n]]
    say(f"fitting {len(every)} steps of {len(names)} report(s)")
    result = fit_steps(every, iterations)
    held = []
    for k, n in enumerate(names if len(names) > 1 else [], start=1):
        say(f"holding out {n} ({k} of {len(names)})")
        rest = [s for m in names if m != n for s in per[m]]
        f = fit_steps(rest, iterations)
        cost = cost_model_from(f["cost_model"])
        fitted, calibrated = _ratios(per[n], cost, f["overhead_ms"]), _ratios(per[n])
        held.append({"report": n, "pairs": {k: {"fitted": fitted[k]["predicted"], "calibrated": calibrated[k]["predicted"],
                                                "measured": v["measured"]} for k, v in fitted.items()}})
    return {**result, "world": worlds.pop(), "reports": names, "held_out": held}


def console(result: dict) -> str:
    from harness.report.text import aligned

    c = result["cost_model"]
    out = [f"fitted on {result['steps']} measured steps of {len(result['reports'])} report(s), {result['world']} ranks: "
           + ", ".join(f"{f} {c[f]:.4g}" for f in FIELDS) + f", per-step overhead {result['overhead_ms']:.1f} ms; "
           f"rms relative step error {result['rms_relative_error']:.3f}"]
    if result["held_out"]:
        rows = [[h["report"].rsplit("/", 1)[-1], k, f"{v['measured']:.3f}", f"{v['fitted']:.3f}", f"{v['calibrated']:.3f}"]
                for h in result["held_out"] for k, v in h["pairs"].items()]
        out += ["", "each report held out, the rest fitted: the ratio of a pair of arms' total step times",
                aligned(["held-out report", "pair", "measured", "fitted model", "calibrated model"], rows)]
        err = {m: statistics.mean(abs(v[m] / v["measured"] - 1) for h in result["held_out"] for v in h["pairs"].values())
               for m in ("fitted", "calibrated")}
        out.append(f"  mean |predicted / measured - 1| over the held-out pairs: fitted {err['fitted']:.3f}, "
                   f"calibrated {err['calibrated']:.3f}")
    return "\n".join(out)
