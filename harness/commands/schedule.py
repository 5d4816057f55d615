"""``dcp-harness schedule``: schedule one global batch and print its table, occupancy map and figures."""

from __future__ import annotations

from harness import cli_types as T
from harness.data.workloads import sample
from harness.io import atomic_write_json, writable
from harness.plan import ALGORITHMS, CostModel, check_schedule, gpt_benchmark_cost, schedule, stats
from harness.plan.limits import MAX_WORK, check_work
from harness.report.text import microbatch_table, occupancy_map, summary

NAME = "schedule"
HELP = "schedule one global batch and show it"
DESCRIPTION = "Schedule one global batch onto a DP x CP domain and print it."


def add_arguments(p) -> None:
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
    p.add_argument("--microbatch-tokens-per-rank", type=T.TOKENS, default=None, metavar="TOKENS",
                   help="balanced only: tokens a rank may hold in one micro-batch over its block's sequences (default "
                        "--max-seqlen-per-rank, which always bounds each sequence): larger for a stack that runs each "
                        "sequence as its own pass, e.g. megatron-core's hybrid CP")
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


def run(a) -> int:
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
                 vpp_group=a.vpp, algorithm=a.algorithm, cost=cost, execution=a.execution,
                 microbatch_tokens_per_rank=a.microbatch_tokens_per_rank)
    bad = check_schedule(s)
    print(f"{a.algorithm}: {len(lengths)} sequences, {sum(lengths)} tokens from {source}; {a.ranks} ranks, "
          f"max_seqlen_per_rank {a.max_seqlen_per_rank}"
          + (f", {a.microbatch_tokens_per_rank} tokens a rank per micro-batch" if a.microbatch_tokens_per_rank else "")
          + f", min_cp {a.min_cp}, vpp {a.vpp}, cost {cost.name}, "
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
