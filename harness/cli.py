"""``dcp-harness`` (also ``python -m harness``): the command line.

  dcp-harness run                      main job: convergence (one stage, a pipeline, the hybrid), schedulers, edge cases, faults
  dcp-harness schedule ...             schedule one global batch; table, occupancy map, --json
  dcp-harness converge ...             train bshd / thd / dcp side by side; report, goldens, wandb
  dcp-harness nightly                  every model, more steps, GPUs if present; history + trend plots
  dcp-harness faults                   the fault catalogue: real dynamic-CP bugs re-created, each must be caught
  dcp-harness bench schedule           scheduler latency and quality benchmark -> reports/
  dcp-harness bench thd                zig-zag index speed (CPU) -> reports/
  dcp-harness bench padding            step-wise batch padding and builder speed (CPU) -> reports/
  dcp-harness bench attention          CP attention throughput on GPUs -> reports/
  dcp-harness bench step               training step time, dynamic vs static CP (GPUs; --cpu smoke) -> reports/
  dcp-harness bench microbatch         host vs device time of one micro-batch per compile mode and backend -> reports/
  dcp-harness bench opaque             host overhead per call of the opaque attention operator -> reports/
  dcp-harness fixtures wikipedia ...   regenerate the committed Wikipedia length sample

Exit codes: 0 success, 1 a verdict or benchmark target failed, 2 bad input (one line on stderr naming the
value, the limit and why; every size, count, seed and wait is bounded: harness.cli_types, harness.plan.limits),
3 a multi-process job failed: a rank raised, died or made no progress (one line names the rank and the log);
130 / 143 interrupted by Ctrl-C / SIGTERM (one line names the log of the job's output so far).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import __version__
from harness import cli_types as T
from harness.apps.nightly import NIGHTLY_MODELS
from harness.apps.nightly.history import HistoryError
from harness.bench.step import COMPILE_CHOICES, GRAD_REDUCE_CHOICES
from harness.golden import GoldenError
from harness.io import OutputPathError
from harness.jobs.watchdog import JobFailure, Terminated
from harness.plan import ALGORITHMS, CostModel, PlanInputError, check_schedule, gpt_benchmark_cost
from harness.plan.limits import MAX_WORK
from harness.runtime.model_config import MODELS


def _add_schedule(sub) -> None:
    p = sub.add_parser("schedule", help="schedule one global batch and show it",
                       description="Schedule one global batch onto a DP x CP domain and print it.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="FILE", help="text file of lengths, one per line ('#' comments, .gz ok)")
    src.add_argument("--dist", metavar="SPEC", help="named distribution, e.g. lognormal:mean=1024,sigma=1.5,min=128,max=8192")
    src.add_argument("--wikipedia", action="store_true", help="the committed Wikipedia sample (see --max-len)")
    p.add_argument("-n", "--num-sequences", type=T.SEQUENCES, default=256,
                   help=f"sequences to draw (default 256, at most {T.MAX_SEQUENCES}; a file gives all)")
    p.add_argument("--seed", type=T.SEED, default=0, help=f"0 to {T.MAX_SEED} (default 0)")
    p.add_argument("--max-len", type=T.LENGTH, default=32768, help="clip for --wikipedia (default 32768)")
    p.add_argument("--ranks", type=T.RANKS, required=True,
                   help=f"DP x CP positions (a power of two, at most {T.MAX_RANKS}; with the sequences at most "
                        f"{MAX_WORK} sequences x ranks)")
    p.add_argument("--max-seqlen-per-rank", type=T.TOKENS, required=True)
    p.add_argument("--min-cp", type=T.MIN_CP, default=1, help="smallest CP block (default 1)")
    p.add_argument("--vpp", type=T.VPP, default=None, help="make the micro-batch count a multiple of this")
    p.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="balanced")
    p.add_argument("--cost", choices=["gpt", "megatron"], default="gpt",
                   help="cost model for balanced and for the printed figures (default: the 12-layer GPT)")
    p.add_argument("--execution", choices=["independent", "synchronous"], default="independent",
                   help="how the step runs, the model balanced optimises and the figures use: independent CP blocks "
                        "(default) or a barrier after every micro-batch (MoE with expert parallelism)")
    p.add_argument("--json", metavar="PATH", help="write the schedule and its figures as JSON")
    p.add_argument("--rows", type=T.ROWS, default=40, help="micro-batches to print (default 40)")


def _cmd_schedule(a) -> int:
    from harness.data.workloads import sample
    from harness.io import atomic_write_json, writable
    from harness.plan import schedule, stats
    from harness.plan.limits import check_work
    from harness.report.text import microbatch_table, occupancy_map, summary

    if a.json:
        writable(a.json)
    if not a.lengths:
        check_work(a.num_sequences, a.ranks)  # before the lengths are drawn (a file's are counted as read)
    if a.lengths:
        lengths, source = sample(f"file:{a.lengths}", None), a.lengths
    elif a.wikipedia:
        lengths, source = sample(f"wikipedia:max={a.max_len}", a.num_sequences, a.seed), f"wikipedia (seed {a.seed})"
    else:
        lengths, source = sample(a.dist, a.num_sequences, a.seed), f"{a.dist} (seed {a.seed})"
    cost = gpt_benchmark_cost() if a.cost == "gpt" else CostModel.megatron()
    s = schedule(lengths, n_ranks=a.ranks, max_seqlen_per_rank=a.max_seqlen_per_rank, min_cp_size=a.min_cp,
                 vpp_group=a.vpp, algorithm=a.algorithm, cost=cost, execution=a.execution)
    bad = check_schedule(s)
    print(f"{a.algorithm}: {len(lengths)} sequences, {sum(lengths)} tokens from {source}; {a.ranks} ranks, "
          f"max_seqlen_per_rank {a.max_seqlen_per_rank}, min_cp {a.min_cp}, vpp {a.vpp}, cost {cost.name}, "
          f"execution {s.execution.describe()}")
    print(microbatch_table(s, a.rows))
    print()
    print(occupancy_map(s, limit=a.rows))
    print()
    print(summary(s))
    print("valid: every invariant holds" if not bad else "INVALID: " + "; ".join(str(v.error()) for v in bad[:5]))
    if a.json:
        st = stats(s)
        atomic_write_json(a.json, {"schedule": s.to_dict(), "microbatches": s.microbatches,
                                   "stats": st.__dict__, "violations": [v.invariant for v in bad]})
        print(f"wrote {a.json}")
    return 0 if not bad else 1


def _add_converge(sub) -> None:
    c = sub.add_parser("converge", help="train bshd / thd / dcp side by side and check they agree",
                       description="Train the layouts side by side (torchrun: gloo on CPU, NCCL on GPUs) and compare.")
    c.add_argument("--layouts", default="bshd,thd,dcp", help="comma-separated: bshd, thd, dcp")
    c.add_argument("--world", type=T.WORLD, default=4, help="ranks (processes or GPUs): pp stages of a power-of-two "
                                                          "DP x CP domain")
    c.add_argument("--steps", type=T.STEPS, default=50)
    c.add_argument("--model", default="tiny-gpt", help=f"one of {', '.join(MODELS)}")
    c.add_argument("--scheduler", default="balanced", help="dynamic-CP scheduler for the dcp layout")
    c.add_argument("--cp-exchange", choices=["gather", "ring", "auto"], default="gather",
                   help="K/V exchange of CP blocks: gather (all-gather; default), ring (overlapped with attention) "
                        "or auto (ring on CUDA from 8K tokens per rank at cp 2 and 4, 16K above)")
    c.add_argument("--pp", type=T.STAGES, default=1, help="pipeline stages (the world is pp stages of a DP x CP domain)")
    c.add_argument("--vpp", type=T.CHUNKS, default=1, help="virtual chunks per stage (interleaved 1F1B when > 1)")
    c.add_argument("--pipeline", choices=["1f1b", "afab"], default="1f1b",
                   help="pipeline schedule (1f1b, or afab: all forwards, then all backwards)")
    c.add_argument("--schedule-delivery", choices=["broadcast", "compute"], default="broadcast",
                   help="dynamic-CP schedules: computed on the first stage and sent down (broadcast) or computed "
                        "by every stage (compute); the stages are checked to agree")
    c.add_argument("--ep", action="store_true",
                   help="expert parallelism (MoE models): shard the experts over each stage's DP x CP domain, "
                        "tokens dispatched to them by all-to-all; the dcp schedule is made for the synchronous "
                        "execution model")
    c.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: float32 on CPU, bfloat16 on GPU")
    c.add_argument("--lengths", default=None, help="length spec of the corpus (harness.data.workloads)")
    c.add_argument("--batch-size", type=T.BATCH_SIZE, default=None, help="sequences per global batch (default 32)")
    c.add_argument("--max-seqlen-per-rank", type=T.TOKENS, default=None)
    c.add_argument("--seed", type=T.SEED, default=None, help=f"corpus seed, 0 to {T.MAX_SEED}")
    c.add_argument("--golden", choices=["auto", "require", "off"], default="auto",
                   help="compare with golden/convergence/<case>.<hw>.json: when it exists (auto), always (require)")
    c.add_argument("--update-golden", action="store_true", help="write the golden of this case from this run")
    c.add_argument("--out", type=Path, default=None, help="report root (default reports/)")
    c.add_argument("--reference", choices=["run", "off"], default="run",
                   help="also train the reference (one rank: no CP, PP or EP; harness.apps.reference) and judge every "
                        "layout against it: losses, gradient norms, step-1 gradients and token losses (default "
                        "run); off: without a golden the verdict is NO REFERENCE")
    c.add_argument("--plant", metavar="FAULT", default=None,
                   help="run with a fault of the catalogue active on every rank (dcp-harness faults --list): "
                        "shows what the verdict says of that bug; it must FAIL")
    _add_stall(c)


def _add_stall(p) -> None:
    p.add_argument("--stall-timeout", type=T.STALL_S, default=None, metavar="SECONDS",
                   help=f"fail when no rank reports progress for this long, naming the rank ({T.MIN_STALL_S:g} to "
                        f"{T.MAX_STALL_S:g}; default: 180 on CPU, 900 on CUDA); collectives time out at twice this")


def _cmd_converge(a) -> int:
    from harness.apps import converge
    from harness.paths import REPORTS

    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cpu":
        T.check_cpu_ranks(a.world, "--world")
    T.check_run_size(a.steps, a.batch_size or converge.DEFAULT_BATCH)
    if a.out is not None:
        T.writable_folder(a.out, "--out")
    cfg = converge.config_from_args(a)
    res = converge.run(cfg, world=a.world, out_root=a.out or REPORTS,
                       golden="update" if a.update_golden else a.golden, stall_s=a.stall_timeout, plant=a.plant,
                       reference_mode=a.reference)
    for c in res.checks:
        mark = "PASS" if c["pass"] else converge.NOT_EXERCISED if c.get("exercise") else "FAIL"
        print(f"  [{mark}] {c['target']}" + ("" if c["value"] != c["value"] else f": {c['value']:.3g}"))
    print(f"report: {res.run_dir / 'index.html'}\nverdict: {res.verdict}")
    return 0 if res.verdict == "PASS" else 1


def _add_faults(sub) -> None:
    f = sub.add_parser("faults", help="run the fault catalogue: every re-created bug must be caught",
                       description="Run every scenario clean (no check may fire), then every fault of the catalogue "
                                   "(harness.faults) with its seam replaced; print which check caught it, where, "
                                   "with what margin. Exit 1 if a fault is missed or a clean run alarms.")
    f.add_argument("--only", nargs="+", metavar="NAME", default=None, help="run only these faults")
    f.add_argument("--list", action="store_true", help="list the faults (name, layer, check, source) and exit")
    f.add_argument("--json", type=Path, default=None, help="result JSON (default reports/faults.json)")
    f.add_argument("--html", type=Path, default=None, help="HTML report (default reports/faults.html)")


def _cmd_faults(a) -> int:
    from harness.faults import FAULTS, select
    from harness.faults.run import run_catalogue, verdict, write
    from harness.io import writable
    from harness.paths import REPORTS
    from harness.report.faults_report import console

    if a.list:
        for f in FAULTS:
            print(f"{f.name:36s} {f.layer:10s} {f.check:20s} {f.source}")
        return 0
    faults = select(a.only)
    json_path, html_path = writable(a.json or REPORTS / "faults.json"), writable(a.html or REPORTS / "faults.html")
    print(f"dcp-harness faults: {len(faults)} faults; clean runs first, then each fault with its seam replaced")
    result = run_catalogue([f.name for f in faults])
    print()
    print(console(result))
    write(result, json_path, html_path)
    print(f"wrote {json_path} and {html_path}")
    return 0 if verdict(result) else 1


def parser() -> argparse.ArgumentParser:
    p = T.Parser(prog="dcp-harness", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--version", action="version", version=f"dcp-harness {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the main job on the embedded CPU default")
    r.add_argument("--batches", type=T.BATCHES, default=3, help="global batches per configuration (default 3)")
    r.add_argument("--out", type=Path, default=None, help="report root (default reports/)")
    r.add_argument("--steps", type=T.STEPS, default=50, help="convergence steps (default 50, which has a golden)")
    r.add_argument("--no-convergence", action="store_true", help="skip every convergence comparison")
    r.add_argument("--no-faults", action="store_true", help="skip the fault catalogue (dcp-harness faults)")
    r.add_argument("--no-pipeline", action="store_true", help="skip the convergence run under pipeline parallelism")
    r.add_argument("--no-hybrid", action="store_true", help="skip the convergence run of the hybrid SSM model")
    _add_stall(r)
    _add_schedule(sub)
    _add_converge(sub)
    _add_faults(sub)
    n = sub.add_parser("nightly", help="every model, more steps, GPUs when present; history with trend plots",
                       description="The nightly convergence job: exit 0 when every case passed, 1 when one failed or "
                                   "was not exercised (dynamic CP never formed a CP group > 1), 2 for a usage error.")
    n.add_argument("--steps", type=T.STEPS, default=100)
    n.add_argument("--models", default=",".join(NIGHTLY_MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    n.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                   help="auto: the distributed cases on GPUs when there are >= 2, else on 4 CPU ranks (and the "
                        "single-GPU numerics on a lone GPU)")
    n.add_argument("--world", type=T.WORLD, default=None, help="ranks of the distributed cases (>= 2; default: min(4, "
                                                           "GPUs) on GPUs, 4 on CPU)")
    n.add_argument("--root", type=Path, default=None, help="default reports/nightly")
    n.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the run's summary as JSON")
    _add_stall(n)
    b = sub.add_parser("bench", help="benchmarks (write reports/<name>.json)")
    bsub = b.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser("schedule", help="scheduler latency and quality vs upstream and the lower bound")
    bs.add_argument("--quick", action="store_true", help="3 configurations instead of 6, a smaller input family")
    bs.add_argument("--batches", type=T.BATCHES, default=5, help="global batches per configuration (default 5)")
    bs.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_schedule.json)")
    bs.add_argument("--execution", choices=["independent", "synchronous", "all"], default="all",
                    help="execution models whose targets the seeded input family checks (default all)")
    bs.add_argument("--seed", type=T.SEED, default=0, help="seed of the input family (default 0)")
    ba = bsub.add_parser("attention", help="(GPU) CP attention fwd+bwd throughput and per-GPU efficiency")
    ba.add_argument("--nproc", type=T.WORLD, default=None, help="GPUs to use (default min(4, available))")
    ba.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_attention.json)")
    _add_stall(ba)
    ba.add_argument("--backend", default="auto",
                    help="attention backend (auto, sdpa, flash, varlen, flash_attn, te; default auto = flash on CUDA)")
    bst = bsub.add_parser("step", help="(GPU) training step time: dynamic CP vs static CP (Megatron's benchmark)")
    bst.add_argument("--nproc", type=T.WORLD, default=None, help="processes (default min(4, GPUs); 2 with --cpu)")
    bst.add_argument("--cpu", action="store_true", help="smoke configuration on gloo (tiny model, no targets)")
    _add_stall(bst)
    bst.add_argument("--model", default=None, help="model key (default gpt-12l-h2048; tiny-gpt with --cpu)")
    bst.add_argument("--lengths", default=None, help="length spec (default lognormal:mean=1024,sigma=1.5,min=128,max=8192)")
    bst.add_argument("--max-seqlen-per-rank", type=T.TOKENS, default=None)
    bst.add_argument("--microbatches", type=T.MICROBATCHES, default=None, help="global batch = this x N x max_seqlen_per_rank tokens (8)")
    bst.add_argument("--global-batch", default=None,
                     help="tokens (default: lengths until --microbatches x N x max_seqlen_per_rank tokens), megatron "
                          "(--microbatches x dp sequences, as Megatron's benchmark_dcp.sh loads: 8 at 4 GPUs with CP 4) "
                          "or sequences:K")
    bst.add_argument("--arms", default=None, help="comma list of layout:scheduler[:padding][@exchange][+scope] "
                                                  "(scope: segments or chain; default thd:dp-balanced,dcp:balanced,dcp:megatron-dev)")
    bst.add_argument("--warmup", type=T.REPEATS0, default=None)
    bst.add_argument("--iters", type=T.REPEATS, default=None)
    bst.add_argument("--profile-iters", type=T.REPEATS0, default=None, help="profiled steps per arm for the breakdown (2)")
    bst.add_argument("--runs", type=T.REPEATS, default=None,
                     help="independent repetitions (each re-calibrates and reruns every arm); targets are judged on "
                          "the median ratio over runs (default 3 on GPUs, 1 with --cpu)")
    bst.add_argument("--gc", choices=["manual", "auto"], default=None,
                     help="Python GC: manual (default; collect between steps, outside the timed window) or auto")
    bst.add_argument("--plan", choices=["ahead", "inline"], default=None,
                     help="schedules computed one step ahead in a planner process (default) or inline, on each "
                          "step's critical path")
    bst.add_argument("--cp-exchange", choices=["gather", "ring", "auto"], default=None,
                     help="K/V exchange of CP blocks: gather (default; all-gather before attention), ring "
                          "(overlapped with attention, TransformerEngine's p2p) or auto (ring on CUDA from 8K tokens "
                          "per rank at cp 2 and 4, 16K above); an arm may override it with @gather / @ring / @auto")
    bst.add_argument("--grad-reduce", choices=list(GRAD_REDUCE_CHOICES), default=None,
                     help="gradient all-reduce: overlap (default; buckets reduced during the last backward) or after")
    bst.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    bst.add_argument("--cp-comm-flops-per-byte", type=T.FLOPS_PER_BYTE, default=None,
                     help="balanced scheduler's price of K/V exchange (default 2000)")
    bst.add_argument("--cost-model", type=Path, default=None,
                     help="fixed scheduler cost model: a bench_step.json (its results.cost_model) or a JSON dict of "
                          "CostModel fields; skips calibration so schedules repeat exactly across runs")
    bst.add_argument("--no-calibrate", action="store_true", help="use the FLOP cost model instead of calibrating")
    bst.add_argument("--calibration-burst", type=T.REPEATS, default=None,
                     help="micro-batches timed back to back per calibration sample (default 4; 1 = one at a time)")
    bst.add_argument("--static-cp", type=T.STATIC_CP, default=None, help="CP size of the thd baseline (default: world)")
    bst.add_argument("--compile", default=None, choices=COMPILE_CHOICES,
                     help="torch.compile the blocks' per-token segments (default auto: inductor-chain on CUDA, eager on CPU; "
                          "reduce-overhead: + CUDA graphs, with --token-bucket; inductor-chain: the whole model as "
                          "one compiled call per micro-batch, attentions opaque)")
    bst.add_argument("--token-bucket", type=T.TOKEN_BUCKET, default=None,
                     help="pad each rank's micro-batch to a multiple of this many tokens (default 0 = off)")
    bst.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_step.json)")
    bst.add_argument("--html", type=Path, default=None, help="HTML path (default: the JSON path with .html)")
    bm = bsub.add_parser("microbatch", help="(GPU) host vs device time of one micro-batch's forward + backward")
    bm.add_argument("--cpu", action="store_true", help="the CPU variant (tiny-gpt, fp32, sdpa)")
    bm.add_argument("--model", default=None, help="model key (default gpt-12l-h2048; tiny-gpt with --cpu)")
    bm.add_argument("--shapes", type=T.shapes, default=None, help="comma list of KxL token shapes (default 1x2048,1x1024,4x512,16x128)")
    bm.add_argument("--variants", default=None,
                    help="comma list of <compile>/<backend> (default off/auto,inductor/varlen,inductor/auto,"
                         "inductor-chain/auto)")
    bm.add_argument("--reps", type=T.REPEATS, default=None, help="timed repetitions per shape and variant (12)")
    bm.add_argument("--warmup", type=T.REPEATS0, default=None, help="untimed calls first (2)")
    bm.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_microbatch.json)")
    bo = bsub.add_parser("opaque", help="host overhead per call of the opaque attention operator (chain compile)")
    bo.add_argument("--against", type=Path, default=None,
                    help="an older harness/runtime/opaque.py to time interleaved with this checkout's "
                         "(e.g. git show REV:harness/runtime/opaque.py > old.py)")
    bo.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    bo.add_argument("--reps", type=T.REPEATS, default=300, help="interleaved repetitions (300)")
    bo.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_opaque.json)")
    bp = bsub.add_parser("padding", help="step-wise RL batches: two-segment vs unified padding, builder speed")
    bp.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_padding.json)")
    bt = bsub.add_parser("thd", help="zig-zag index computation speed (CPU)")
    bt.add_argument("--out", type=Path, default=None, help="JSON path (default reports/bench_thd.json)")
    f = sub.add_parser("fixtures", help="regenerate committed fixtures")
    fsub = f.add_subparsers(dest="fixture", required=True)
    fw = fsub.add_parser("wikipedia", help="seeded sample of the Wikipedia document lengths")
    fw.add_argument("--source", required=True, help="wikipedia_doc_lengths.txt.gz (one length per line)")
    fw.add_argument("--n", type=T.SAMPLE, default=65536)
    fw.add_argument("--seed", type=T.SEED, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        if a.command == "run":
            from harness.apps import main_job
            from harness.paths import REPORTS

            conv = None if a.no_convergence else {**main_job.DEFAULT_CONVERGENCE, "steps": a.steps}
            skip = a.no_pipeline or a.no_convergence
            pipe = None if skip else {**main_job.DEFAULT_PIPELINE, "steps": a.steps}
            hybrid = None if a.no_hybrid or a.no_convergence else {**main_job.DEFAULT_HYBRID, "steps": a.steps}
            if a.out is not None:
                T.writable_folder(a.out, "--out")
            code, _ = main_job.run(quick_batches=a.batches, out_root=a.out or REPORTS, convergence=conv,
                                   pipeline=pipe, hybrid=hybrid, faults=not a.no_faults, stall_s=a.stall_timeout)
            return code
        if a.command == "schedule":
            return _cmd_schedule(a)
        if a.command == "converge":
            return _cmd_converge(a)
        if a.command == "faults":
            return _cmd_faults(a)
        if a.command == "nightly":
            from harness.apps import nightly

            if a.world is not None and _cpu_ranks(a.device):
                T.check_cpu_ranks(a.world, "--world")
            return nightly.run(steps=a.steps, models=tuple(m.strip() for m in a.models.split(",") if m.strip()),
                               device=a.device, world=a.world, root=a.root or nightly.NIGHTLY,
                               stall_s=a.stall_timeout, json_path=a.json)
        if a.command == "bench":
            from harness.io import writable

            for path in (getattr(a, "out", None), getattr(a, "html", None)):
                if path is not None:
                    writable(path)  # before the benchmark runs, not after
            if a.bench == "attention":
                from harness.bench import attention

                _check_gpus(a.nproc)
                return attention.main(out=a.out, nproc=a.nproc, cfg={"backend": a.backend}, stall_s=a.stall_timeout)
            if a.bench == "step":
                from harness.bench import step

                if a.cpu and a.nproc is not None:
                    T.check_cpu_ranks(a.nproc, "--nproc")
                keys = ("model", "lengths", "max_seqlen_per_rank", "microbatches", "warmup", "iters", "profile_iters",
                        "dtype", "cp_comm_flops_per_byte", "static_cp", "compile", "token_bucket", "runs", "gc", "plan",
                        "grad_reduce", "calibration_burst", "cp_exchange", "global_batch")
                over = {k: getattr(a, k) for k in keys if getattr(a, k) is not None}
                if a.no_calibrate:
                    over["calibrate"] = False
                if a.cost_model:
                    over["cost_model"] = step.load_cost_model(a.cost_model)
                if a.arms:
                    over["arms"] = tuple(x.strip() for x in a.arms.split(",") if x.strip())
                return step.main(nproc=a.nproc, out=a.out, html=a.html, cpu=a.cpu, overrides=over,
                                 stall_s=a.stall_timeout)
            if a.bench == "microbatch":
                from harness.bench import microbatch

                over = {k: getattr(a, k) for k in ("model", "reps", "warmup") if getattr(a, k) is not None}
                for k in ("shapes", "variants"):
                    if getattr(a, k):
                        over[k] = tuple(x.strip() for x in getattr(a, k).split(",") if x.strip())
                return microbatch.main(cpu=a.cpu, out=a.out, overrides=over)
            if a.bench == "opaque":
                from harness.bench import microbatch

                return microbatch.opaque_main(against=a.against, device=a.device, reps=a.reps, out=a.out)
            if a.bench == "padding":
                from harness.bench import padding

                return padding.main(out=a.out)
            if a.bench == "thd":
                from harness.bench import thd

                return thd.main(out=a.out)
            from harness.bench import schedule as bench_schedule

            return bench_schedule.main(quick=a.quick, batches=a.batches, out=a.out, execution=a.execution,
                                       seed=a.seed)
        if a.command == "fixtures":
            from harness.data.workloads import make_wikipedia_sample

            print(f"wrote {make_wikipedia_sample(a.source, a.n, a.seed)}")
            return 0
    except (PlanInputError, GoldenError, OutputPathError, HistoryError, T.UsageError) as e:
        print(f"dcp-harness: error: {_line(e)}", file=sys.stderr)
        return 2
    except JobFailure as e:
        print(f"dcp-harness: error: {_line(e)}", file=sys.stderr)
        return 3
    except Terminated as e:
        print(f"dcp-harness: terminated by {e}; the job's processes were killed{_output(e)}", file=sys.stderr)
        return 143
    except KeyboardInterrupt as e:
        killed = "; the job's processes were killed" if hasattr(e, "log") else ""
        print(f"dcp-harness: interrupted{killed}{_output(e)}", file=sys.stderr)
        return 130
    return 2


def _line(e: BaseException) -> str:
    """An error's message as the one line the exit codes promise."""
    return " ".join(str(e).splitlines())


def _output(e: BaseException) -> str:
    """Where an interrupted job's output so far is (``harness.jobs.entry.launch`` sets ``log``), if it was kept."""
    log = getattr(e, "log", None)
    return f"; output: {log}" if log is not None and Path(log).exists() else ""


def _cpu_ranks(device: str) -> bool:
    """Whether ``nightly --device`` runs its distributed cases on CPU ranks (auto: fewer than 2 GPUs)."""
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available() or torch.cuda.device_count() < 2


def _check_gpus(nproc: int | None) -> None:
    """``--nproc`` GPU processes need that many visible GPUs (without CUDA the benchmark says so itself)."""
    if nproc is None:
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found and nproc > found:
        raise T.UsageError(f"--nproc {nproc} needs {nproc} GPUs but {found} are visible; use --nproc {found} or fewer")
