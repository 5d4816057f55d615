"""``dcp-harness bench step``: training step time, dynamic against static CP (GPUs; ``--cpu`` a smoke run).

Every option whose dest is a field of ``StepBenchConfig`` overrides that field when given (``overrides``);
the others (``--nproc``, ``--cpu``, ``--stall-timeout``, ``--out``, ``--html``, the node options) say how the job
runs."""

from __future__ import annotations

from pathlib import Path

from harness import cli_types as T
from harness.bench.step import COMPILE_CHOICES, GRAD_REDUCE_CHOICES, StepBenchConfig, load_cost_model, main
from harness.commands.common import add_nodes, add_out, add_stall, names, nodes_from, overrides

NAME = "step"
HELP = "(GPU) training step time: dynamic CP vs static CP (Megatron's benchmark)"
DESCRIPTION = None
def named_cost_models(pairs: list[str]) -> dict:
    """``--arm-cost-model NAME=PATH`` (repeated) -> {NAME: cost-model fields}; a malformed or repeated NAME is a
    usage error naming it."""
    out = {}
    for pair in pairs:
        name, eq, path = str(pair).partition("=")
        if not eq or not name or not path:
            raise T.UsageError(f"--arm-cost-model {pair!r}: give NAME=PATH, e.g. fit=reports/recorded/bench_fit.h200x4.json")
        if name in out:
            raise T.UsageError(f"--arm-cost-model {name!r} given twice: one path per name")
        out[name] = load_cost_model(path)
    return out


CONVERT = {"arms": names, "cost_model": load_cost_model, "arm_cost_models": named_cost_models}
"""Fields whose option's text is parsed first: a comma list of arms, a cost model file."""


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=T.WORLD, default=None, help="processes (default min(4, GPUs); 2 with --cpu)")
    p.add_argument("--cpu", action="store_true", help="smoke configuration on gloo (tiny model, no targets)")
    add_stall(p)
    add_nodes(p)
    p.add_argument("--stack", choices=["harness", "megatron-core"], default="harness",
                   help="whose step is timed: the harness's runtime (default) or megatron-core + TE's own hybrid-CP "
                        "step (arms static, megatron-core, balanced: harness.bench.stack_step)")
    p.add_argument("--stack-arms", default=None, help="with --stack megatron-core: a comma list of static, "
                                                      "megatron-core, balanced (default all three)")
    p.add_argument("--workarounds", default="all", help="with --stack megatron-core: the stack's workarounds of "
                                                        "upstream defects (all, none or a comma list)")
    p.add_argument("--stack-option", action="append", default=[], metavar="KEY=VALUE",
                   help="with --stack megatron-core: passed to the stack (e.g. max_seqlen=pow2, cp_comm=all_gather); "
                        "repeatable")
    p.add_argument("--model", default=None, help="model key (default gpt-12l-h2048; tiny-gpt with --cpu)")
    p.add_argument("--lengths", default=None, help="length spec (default lognormal:mean=1024,sigma=1.5,min=128,max=8192)")
    p.add_argument("--max-seqlen-per-rank", type=T.TOKENS, default=None)
    p.add_argument("--microbatches", type=T.MICROBATCHES, default=None, help="global batch = this x N x max_seqlen_per_rank tokens (8)")
    p.add_argument("--global-batch", default=None,
                   help="tokens (default: lengths until --microbatches x N x max_seqlen_per_rank tokens), megatron "
                        "(--microbatches x dp sequences, as Megatron's benchmark_dcp.sh loads: 8 at 4 GPUs with CP 4) "
                        "or sequences:K")
    p.add_argument("--arms", default=None, help="comma list of layout:scheduler[:padding][@exchange][+scope] "
                                                "(scope: segments or chain; default thd:dp-balanced,dcp:balanced,dcp:megatron-dev)")
    p.add_argument("--warmup", type=T.REPEATS0, default=None,
                   help="unmeasured steps per arm first (10; with --cpu 1, or 2 when it compiles): a measured step "
                        "that compiles fails the check 'no measured step compiled'")
    p.add_argument("--iters", type=T.REPEATS, default=None, help="measured steps per arm and run (30; 3 with --cpu)")
    p.add_argument("--profile-iters", type=T.REPEATS0, default=None, help="profiled steps per arm for the breakdown (2)")
    p.add_argument("--runs", type=T.REPEATS, default=None,
                   help="independent repetitions (each re-calibrates and reruns every arm); targets are judged on "
                        "the median ratio over runs (default 3 on GPUs, 1 with --cpu)")
    p.add_argument("--gc", choices=["manual", "auto"], default=None,
                   help="Python GC: manual (default; collect between steps, outside the timed window) or auto")
    p.add_argument("--plan", choices=["ahead", "inline"], default=None,
                   help="schedules computed one step ahead in a planner process (default) or inline, on each "
                        "step's critical path")
    p.add_argument("--cp-exchange", choices=["gather", "ring", "a2a", "auto"], default=None,
                   help="K/V exchange of CP blocks: gather (default; all-gather before attention), ring "
                        "(overlapped with attention, TransformerEngine's p2p), a2a (all-to-all over heads) or auto (ring on CUDA from 8K tokens "
                        "per rank at cp 2 and 4, 16K above); an arm may override it with @gather / @ring / @a2a / @auto")
    p.add_argument("--ep", dest="expert_parallel", action="store_true", default=None,
                   help="MoE models (moe-12l-h2048; tiny-moe with --cpu): shard the experts over the ranks; the arms "
                        "may name the execution model their schedules are made for (dcp:balanced:local:synchronous)")
    p.add_argument("--moe-aux-loss", type=T.AUX_COEF, default=None, metavar="COEF",
                   help="MoE models: the routers' sequence-level load-balancing loss with this coefficient in every "
                        "arm's step (the step converge --moe-aux-loss verifies); default: none")
    p.add_argument("--loss-chunk", type=T.LOSS_CHUNK, default=None, metavar="TOKENS",
                   help="every arm's LM head and loss this many tokens at a time (the step converge --loss-chunk "
                        "verifies; with --compile off: the compiled head is whole); default 0: the whole logits")
    p.add_argument("--grad-reduce", choices=list(GRAD_REDUCE_CHOICES), default=None,
                   help="gradient all-reduce: overlap (default; buckets reduced during the last backward) or after")
    p.add_argument("--optimizer", choices=["replicated", "distributed"], default=None,
                   help="replicated (default: every rank keeps the whole AdamW) or distributed (each rank keeps and "
                        "updates 1/N of it: the overlapped buckets reduce-scattered, the parameters all-gathered after "
                        "the update; the step converge --optimizer distributed verifies)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    p.add_argument("--cp-comm-flops-per-byte", type=T.FLOPS_PER_BYTE, default=None,
                   help="balanced scheduler's price of K/V exchange (default 2000)")
    p.add_argument("--cost-model", type=Path, default=None,
                   help="fixed scheduler cost model: a bench_step.json (its results.cost_model) or a JSON dict of "
                        "CostModel fields; skips calibration so schedules repeat exactly across runs")
    p.add_argument("--arm-cost-model", dest="arm_cost_models", action="append", default=None, metavar="NAME=PATH",
                   help="a fixed cost model (a bench_step.json or bench fit JSON, or a JSON dict of CostModel fields) for "
                        "the arms that name it (dcp:balanced~NAME); the other arms keep the run's cost: a calibrated "
                        "and a fitted model side by side in one run; repeatable")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false", default=None,
                   help="use the FLOP cost model instead of calibrating")
    p.add_argument("--calibration-burst", type=T.REPEATS, default=None,
                   help="micro-batches timed back to back per calibration sample (default 4; 1 = one at a time)")
    p.add_argument("--static-cp", type=T.STATIC_CP, default=None, help="CP size of the thd baseline (default: world)")
    p.add_argument("--compile", default=None, choices=COMPILE_CHOICES,
                   help="torch.compile the blocks' per-token segments (default auto: inductor-chain on CUDA, eager on CPU; "
                        "reduce-overhead: + CUDA graphs, with --token-bucket; inductor-chain: the whole model as "
                        "one compiled call per micro-batch, attentions opaque)")
    p.add_argument("--token-bucket", type=T.TOKEN_BUCKET, default=None,
                   help="pad each rank's micro-batch to a multiple of this many tokens: 0 = off, or auto (default: "
                        "64 on CUDA when it divides --max-seqlen-per-rank, else off; an arm's #N overrides it)")
    add_out(p, "bench_step.json")
    p.add_argument("--html", type=Path, default=None, help="HTML path (default: the JSON path with .html)")


def run(a) -> int:
    from harness.commands.verify import options  # KEY=VALUE pairs, values read as JSON when they parse

    if a.stack == "megatron-core":
        if a.cpu:
            raise T.UsageError("bench step --stack megatron-core runs on CUDA GPUs only (TransformerEngine); drop --cpu")
        if a.numa_binding is not None:
            raise T.UsageError("--numa-binding binds the harness runtime's ranks (torchrun's option); with --stack "
                               "megatron-core the stack's job starts its own ranks: leave it out")
        if a.moe_aux_loss:
            raise T.UsageError("--moe-aux-loss trains the harness runtime's MoE routers; the megatron-core stack's arms "
                               "run its own router (--moe-router-load-balancing-type there): leave it out")
        if a.loss_chunk:
            raise T.UsageError("--loss-chunk runs the harness runtime's loss head; the megatron-core stack's arms run "
                               "its own output layer and loss: leave it out")
        if a.arm_cost_models:
            raise T.UsageError("--arm-cost-model gives the runtime's arms (dcp:balanced~NAME) a cost model; with --stack "
                               "megatron-core its balanced arm takes --cost-model FILE (or the stack's calibration)")
        from harness.bench.stack_step import main as stack_main  # lazy: imports torch

        return stack_main(nproc=a.nproc, out=a.out, overrides=overrides(a, StepBenchConfig, CONVERT),
                          stall_s=a.stall_timeout, arms=names(a.stack_arms) if a.stack_arms else None,
                          workarounds=a.workarounds, stack_options=options(a.stack_option))
    if a.cpu and a.nproc is not None:
        T.check_cpu_ranks(a.nproc, "--nproc")
    nodes, _ = nodes_from(a, a.nnodes, "cpu" if a.cpu else "cuda")
    return main(nproc=a.nproc, out=a.out, html=a.html, cpu=a.cpu, overrides=overrides(a, StepBenchConfig, CONVERT),
                nodes=nodes, stall_s=a.stall_timeout)
