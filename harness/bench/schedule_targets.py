"""The scheduler targets of ``dcp-harness bench schedule``, per execution model, side by side with megatron-dev.

On the seeded family (``schedule_family``) every input is scheduled by ``balanced`` (given the GPT cost and
the execution model) and ``megatron-dev``, and both are judged by the simulated step time under that cost and
model. Per model the table gives, each with its verdict:

* worst ratio balanced / megatron-dev over the family (<= 1.01; the input is printed) and the geometric
  mean speedup megatron-dev / balanced (>= 1.05), over the inputs both can schedule;
* quality (step / lower bound, <= 1.05) wherever there are >= 8 sequences per rank: the family's such inputs
  and the latency sizes below, plus 1024 ranks x 8192 sequences of mean 4096 (16384 tokens per rank);
* latency of ``balanced`` (median wall time of repeated calls) at 64 ranks x 512 sequences (<= 5 ms), 1024 x
  8192 (<= 50 ms) and 4096 x 32768 (<= 250 ms), lognormal mean 1024, 2048 tokens per rank; it depends on
  what else runs on the machine (the quick mode skips the largest);
* validity (``check_schedule``) of every schedule of ``balanced`` and determinism (two calls, one schedule).
"""

from __future__ import annotations

import math

from harness.bench.common import time_call
from harness.bench.schedule_family import Case, family
from harness.data.workloads import sample
from harness.finite import within, worst_of
from harness.plan import CostModel, VPPAlignmentError, check_schedule, quality, schedule, simulate

EXECUTIONS = ("independent", "synchronous")
LN1024 = "lognormal:mean=1024,sigma=1.5,min=128,max=8192"
LN4096 = "lognormal:mean=4096,sigma=1.5,min=256,max=131072"
LATENCY = {(64, 512): 5.0, (1024, 8192): 50.0, (4096, 32768): 250.0}
QUICK_LATENCY = ((64, 512), (1024, 8192))
DENSE = [("lognormal-4096", LN4096, 1024, 8192, 16384)]
"""Quality-only inputs besides the latency sizes: (name, spec, ranks, sequences, tokens per rank)."""
WORST_RATIO, GEO_SPEEDUP, QUALITY = 1.01, 1.05, 1.05


def _step(lengths, case: Case | dict, algorithm: str, cost: CostModel, ex: str):
    kw = case.kwargs() if isinstance(case, Case) else case
    try:
        s = schedule(list(lengths), algorithm=algorithm, cost=cost, execution=ex, **kw)
    except VPPAlignmentError:
        return None, None
    return s, simulate(s, cost, ex).step_time


def compare(cases: list[Case], cost: CostModel, ex: str, progress=print) -> dict:
    """balanced vs megatron-dev on ``cases`` under ``ex``: per-case rows and the aggregate figures."""
    rows, invalid, nondet, unmatched = [], [], [], []
    for c in cases:
        b, tb = _step(c.lengths, c, "balanced", cost, ex)
        d, td = _step(c.lengths, c, "megatron-dev", cost, ex)
        if b is None:
            if d is not None:
                unmatched.append(c.index)
            continue
        if check_schedule(b):
            invalid.append(c.index)
        if _step(c.lengths, c, "balanced", cost, ex)[0].microbatches != b.microbatches:
            nondet.append(c.index)
        rows.append({"case": c.index, "ranks": c.n_ranks, "sequences": len(c.lengths), "balanced": tb,
                     "megatron_dev": td, "ratio": None if td is None else tb / td,
                     "quality": quality(b, cost, ex), "per_rank": len(c.lengths) / c.n_ranks})
    paired = [r for r in rows if r["ratio"] is not None]
    worst = max(paired, key=lambda r: r["ratio"], default=None)
    geo = math.exp(-sum(math.log(r["ratio"]) for r in paired) / len(paired)) if paired else float("nan")
    progress(f"  family under {ex}: {len(rows)} inputs scheduled, {len(paired)} beside megatron-dev")
    return {"rows": rows, "worst": worst, "geo_speedup": geo, "slower": sum(r["ratio"] > WORST_RATIO for r in paired),
            "invalid": invalid, "nondeterministic": nondet, "failed_where_dev_did_not": unmatched}


def dense_quality(cost: CostModel, ex: str, sizes, extra=DENSE, progress=print) -> list[dict]:
    """Quality of ``balanced`` and megatron-dev (when cheap enough to run) on the >= 8 per rank inputs."""
    out = []
    inputs = [("lognormal-1024", LN1024, n, k, 2048) for n, k in sizes] + list(extra)
    for name, spec, n, k, mslpr in inputs:
        lengths = sample(spec, k, 0)
        kw = dict(n_ranks=n, max_seqlen_per_rank=mslpr)
        b, _ = _step(lengths, kw, "balanced", cost, ex)
        d = _step(lengths, kw, "megatron-dev", cost, ex)[0] if n * k <= 64 * 1024 else None
        out.append({"input": f"{name} {n} ranks x {k} sequences", "quality": quality(b, cost, ex),
                    "megatron_dev": None if d is None else quality(d, cost, ex)})
        progress(f"  quality under {ex}: {out[-1]['input']} done")
    return out


def latency(cost: CostModel, ex: str, sizes) -> list[dict]:
    out = []
    for n, k in sizes:
        lengths = sample(LN1024, k, 0)
        t, _ = time_call(lambda: schedule(lengths, n_ranks=n, max_seqlen_per_rank=2048, cost=cost, execution=ex),
                         min_total_s=0.3 if n < 4096 else 0.0, max_reps=7 if n < 4096 else 2)
        out.append({"ranks": n, "sequences": k, "latency_ms": t * 1e3, "limit_ms": LATENCY[(n, k)]})
    return out


def run(cost: CostModel, executions=EXECUTIONS, *, quick: bool = False, seed: int = 0, progress=print) -> dict:
    """Every execution model's figures and checks (see the module doc)."""
    cases = family(seed, count=24 if quick else 120, large=0 if quick else 4)
    sizes = QUICK_LATENCY[:1] if quick else tuple(LATENCY)
    models = {}
    for ex in executions:
        fam = compare(cases, cost, ex, progress)
        per_rank = [r for r in fam["rows"] if r["per_rank"] >= 8]
        dense = dense_quality(cost, ex, sizes, [] if quick else DENSE, progress)
        lat = latency(cost, ex, sizes)
        models[ex] = {"family": fam, "dense": dense, "latency": lat,
                      "checks": checks(ex, fam, per_rank, dense, lat)}
    return {"cases": len(cases), "seed": seed, "models": models}


def checks(ex: str, fam: dict, per_rank: list[dict], dense: list[dict], lat: list[dict]) -> list[dict]:
    out = []
    w = fam["worst"]
    if w is not None:
        out.append({"target": f"[{ex}] worst balanced / megatron-dev <= {WORST_RATIO} (case #{w['case']}, "
                              f"{w['ranks']} ranks x {w['sequences']} seqs)", "value": w["ratio"],
                    "pass": within(w["ratio"], WORST_RATIO)})
        out.append({"target": f"[{ex}] geometric-mean speedup over megatron-dev >= {GEO_SPEEDUP}",
                    "value": fam["geo_speedup"], "pass": within(fam["geo_speedup"], GEO_SPEEDUP, ">=")})
    qs = [(f"family #{r['case']}", r["quality"]) for r in per_rank] + [(d["input"], d["quality"]) for d in dense]
    if qs:
        name, q = worst_of(qs, key=lambda x: x[1])
        out.append({"target": f"[{ex}] quality <= {QUALITY} at >= 8 sequences per rank ({len(qs)} inputs; worst: "
                              f"{name})", "value": q, "pass": within(q, QUALITY)})
    for r in lat:
        out.append({"target": f"[{ex}] latency <= {r['limit_ms']:g} ms at ({r['ranks']}, {r['sequences']})",
                    "value": r["latency_ms"], "pass": within(r["latency_ms"], r["limit_ms"])})
    bad = fam["invalid"] + fam["failed_where_dev_did_not"]
    out.append({"target": f"[{ex}] every schedule valid, and one wherever megatron-dev has one", "value": len(bad),
                "pass": not bad})
    out.append({"target": f"[{ex}] deterministic (two calls, one schedule)", "value": len(fam["nondeterministic"]),
                "pass": not fam["nondeterministic"]})
    return out


def render(result: dict, cases: list[Case] | None = None) -> str:
    """Per execution model: the figures and the verdicts, and the worst input in full."""
    by_index = {c.index: c for c in cases or []}
    lines = []
    for ex, m in result["models"].items():
        fam = m["family"]
        lines += ["", f"execution model: {ex} ({result['cases']} family inputs, seed {result['seed']})"]
        lines.append(f"  balanced vs megatron-dev: geometric-mean speedup {fam['geo_speedup']:.4f}, slower by > 1% on "
                     f"{fam['slower']} of {sum(r['ratio'] is not None for r in fam['rows'])}")
        if fam["worst"] is not None and fam["worst"]["case"] in by_index:
            lines.append(f"  worst input: {by_index[fam['worst']['case']].describe()}")
        for d in m["dense"]:
            dev = "-" if d["megatron_dev"] is None else f"{d['megatron_dev']:.4f}"
            lines.append(f"  quality {d['input']}: balanced {d['quality']:.4f}, megatron-dev {dev}")
        for c in m["checks"]:
            lines.append(f"  [{'PASS' if c['pass'] else 'FAIL'}] {c['target']}: {c['value']:.4g}")
    return "\n".join(lines)
