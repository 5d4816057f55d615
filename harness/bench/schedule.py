"""``dcp-harness bench schedule``: scheduler latency and quality, side by side in one run.

For every (distribution, ranks, sequences) configuration it draws ``batches`` global batches
(seeds 0..batches-1) and runs every scheduler on each batch in turn: ours (``balanced``, given the
GPT cost; ``balanced[L2]``, given upstream's ``L**2/cp`` estimate), the Megatron parity models
(``megatron-dev``, ``megatron-pr2000``), the static-CP baseline (``dp-balanced``) and the installed
megatron-core scheduler (``megatron-core``, when installed). Figures per configuration and scheduler
are medians over batches of: latency (itself a median of repeated calls), quality = simulated step
time / lower bound under the 12-layer, hidden-2048, FFN-8192 GPT cost (and under ``L**2/cp``),
micro-batch count, and the number of batches whose schedule breaks an invariant.

Then, per execution model (``--execution independent|synchronous|all``), the targets on a seeded family of
varied inputs beside megatron-dev (``harness.bench.schedule_targets``), each with its verdict.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from harness.bench import schedule_targets
from harness.bench.common import table, time_call, write_report
from harness.bench.schedule_family import family
from harness.data.workloads import sample
from harness.finite import within, worst
from harness.plan import CostModel, check_schedule, gpt_benchmark_cost, schedule, stats
from harness.plan.layout import Schedule
from harness.upstream import megatron

DISTRIBUTIONS = {
    "lognormal-1024": ("lognormal:mean=1024,sigma=1.5,min=128,max=8192", 2048),
    "lognormal-4096": ("lognormal:mean=4096,sigma=1.5,min=256,max=131072", 16384),
    "wikipedia": ("wikipedia:max=32768", 4096),
}
CONFIGS = [(8, 64), (8, 256), (32, 256), (64, 512), (64, 1024), (256, 2048)]
QUICK_CONFIGS = [(8, 256), (32, 256), (64, 512)]
TARGETS = {"latency_ms": {(64, 512): 5.0, (256, 2048): 50.0}, "quality_lognormal_1024": 1.05}


@dataclass(frozen=True)
class Scheduler:
    name: str
    run: Callable[[list[int], int, int], Schedule]


def schedulers(gpt: CostModel, with_upstream: bool = True) -> list[Scheduler]:
    def ours(algorithm: str, cost: CostModel | None) -> Callable:
        return lambda L, n, m: schedule(L, n_ranks=n, max_seqlen_per_rank=m, algorithm=algorithm, cost=cost)

    out = [Scheduler("balanced", ours("balanced", gpt)),
           Scheduler("balanced[L2]", ours("balanced", CostModel.megatron())),
           Scheduler("megatron-dev", ours("megatron-dev", None)),
           Scheduler("megatron-pr2000", ours("megatron-pr2000", None)),
           Scheduler("dp-balanced", ours("dp-balanced", None))]
    if with_upstream and megatron.available():
        out.append(Scheduler("megatron-core", lambda L, n, m: megatron.schedule(L, n_ranks=n, max_seqlen_per_rank=m)))
    return out


def _measure(s: Scheduler, lengths, n: int, mslpr: int, gpt: CostModel) -> dict:
    latency, sched = time_call(lambda: s.run(lengths, n, mslpr))
    sched = Schedule(sched.layout, sched.lengths, n, mslpr, algorithm=s.name, cost=gpt)
    bad = check_schedule(sched)
    st = stats(sched, gpt)
    return {"latency_ms": latency * 1e3, "quality": st.quality, "quality_l2": stats(sched, CostModel.megatron()).quality,
            "microbatches": st.num_microbatches, "invalid": bool(bad), "violations": sorted({v.invariant for v in bad})}


def run(*, quick: bool = False, batches: int = 5, dists: list[str] | None = None, progress=print) -> dict:
    gpt = gpt_benchmark_cost()
    configs = QUICK_CONFIGS if quick else CONFIGS
    scheds = schedulers(gpt)
    rows = []
    for dist in dists or list(DISTRIBUTIONS):
        spec, mslpr = DISTRIBUTIONS[dist]
        for n, num in configs:
            per: dict[str, list[dict]] = {s.name: [] for s in scheds}
            for seed in range(batches):
                lengths = sample(spec, num, seed)
                for s in scheds:
                    per[s.name].append(_measure(s, lengths, n, mslpr, gpt))
            for name, ms in per.items():
                rows.append({"distribution": dist, "ranks": n, "sequences": num, "max_seqlen_per_rank": mslpr,
                             "scheduler": name, **{k: statistics.median(m[k] for m in ms)
                                                   for k in ("latency_ms", "quality", "quality_l2", "microbatches")},
                             "invalid_batches": sum(m["invalid"] for m in ms),
                             "violations": sorted({v for m in ms for v in m["violations"]})})
            progress(f"  {dist:15s} ranks={n:<4d} seqs={num:<5d} done")
    return {"rows": rows, "checks": check_targets(rows), "schedulers": [s.name for s in scheds],
            "cost": gpt.to_dict(), "batches": batches, "quick": quick}


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, each with its measured figure and a verdict."""
    out = []
    mine = {(r["distribution"], r["ranks"], r["sequences"]): r for r in rows if r["scheduler"] == "balanced"}
    dev = {(r["distribution"], r["ranks"], r["sequences"]): r for r in rows if r["scheduler"] == "megatron-dev"}
    for (n, num), limit in TARGETS["latency_ms"].items():
        lat = [r["latency_ms"] for k, r in mine.items() if k[1:] == (n, num)]
        if lat:
            out.append({"target": f"balanced latency <= {limit:g} ms at ({n}, {num})", "value": worst(lat),
                        "pass": within(worst(lat), limit)})
    for k, r in mine.items():
        if k[0] == "lognormal-1024" and k[2] >= 32 * k[1]:
            out.append({"target": f"balanced quality <= 1.05 on {k}", "value": r["quality"],
                        "pass": within(r["quality"], TARGETS["quality_lognormal_1024"])})
        if k in dev:
            out.append({"target": f"balanced quality < megatron-dev on {k}", "value": r["quality"] / dev[k]["quality"],
                        "pass": within(r["quality"] / dev[k]["quality"], 1.0, "<")})
    for r in rows:
        if r["scheduler"] != "megatron-core" and r["invalid_batches"]:
            out.append({"target": f"{r['scheduler']} valid on {r['distribution']} ({r['ranks']}, {r['sequences']})",
                        "value": r["invalid_batches"], "pass": False})
    return out


COLUMNS = [("distribution", "distribution", "s"), ("ranks", "ranks", "d"), ("sequences", "seqs", "d"),
           ("scheduler", "scheduler", "s"), ("latency_ms", "latency ms", ".2f"), ("quality", "quality", ".3f"),
           ("quality_l2", "q(L^2/cp)", ".3f"), ("microbatches", "#mb", ".0f"), ("invalid_batches", "invalid", "d")]


def main(*, quick: bool = False, batches: int = 5, out=None, execution: str = "all", seed: int = 0) -> int:
    """The grid (independent model), then the family's targets under each execution model of ``execution``
    (``independent``, ``synchronous`` or ``all``; ``harness.bench.schedule_targets``)."""
    executions = schedule_targets.EXECUTIONS if execution == "all" else (execution,)
    print(f"bench schedule: {'quick' if quick else 'full'} grid, {batches} global batches per configuration")
    result = run(quick=quick, batches=batches)
    print(table(result["rows"], COLUMNS))
    print()
    for c in result["checks"]:
        print(f"  [{'PASS' if c['pass'] else 'FAIL'}] {c['target']}: {c['value']:.4g}")
    gpt = gpt_benchmark_cost()
    targets = schedule_targets.run(gpt, executions, quick=quick, seed=seed)
    print(schedule_targets.render(targets, family(seed, count=24 if quick else 120, large=0 if quick else 4)))
    checks = result["checks"] + [c for m in targets["models"].values() for c in m["checks"]]
    path = write_report("schedule", {"quick": quick, "batches": batches, "configs": QUICK_CONFIGS if quick else CONFIGS,
                                     "distributions": DISTRIBUTIONS, "executions": list(executions), "seed": seed},
                        result["rows"], out=out, checks=checks, cost=result["cost"], targets=targets)
    print(f"\nwrote {path}")
    return 0 if all(c["pass"] for c in checks) else 1
