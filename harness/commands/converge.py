"""``dcp-harness converge``: train the layouts side by side (torchrun) and judge them against the reference."""

from __future__ import annotations

from pathlib import Path

from harness import cli_types as T
from harness.commands.common import add_nodes, add_stall, nodes_from
from harness.paths import REPORTS
from harness.runtime.model_config import MODELS

NAME = "converge"
HELP = "train bshd / thd / dcp side by side and check they agree"
DESCRIPTION = "Train the layouts side by side (torchrun: gloo on CPU, NCCL on GPUs) and compare."


def add_arguments(c) -> None:
    c.add_argument("--layouts", default="bshd,thd,dcp", help="comma-separated: bshd, thd, dcp")
    c.add_argument("--world", type=T.WORLD, default=4, help="ranks (processes or GPUs): pp stages of a power-of-two "
                                                          "DP x CP domain, times tp")
    c.add_argument("--steps", type=T.STEPS, default=50)
    c.add_argument("--model", default="tiny-gpt", help=f"one of {', '.join(MODELS)}")
    c.add_argument("--scheduler", default="balanced", help="dynamic-CP scheduler for the dcp layout")
    c.add_argument("--cp-exchange", choices=["gather", "ring", "a2a", "auto", "te:p2p", "te:all_gather", "te:a2a"],
                   default=None,
                   help="K/V exchange of CP blocks: gather (all-gather; default), ring (overlapped with attention), "
                        "a2a (all-to-all over heads: whole sequences, heads / cp a rank), auto (ring on CUDA from 8K tokens per rank at cp 2 and 4, 16K above), or TransformerEngine's "
                        "CP attention with its communication type (te:...; CUDA, the gpu extra)")
    c.add_argument("--attention", choices=["harness", "te"], default="harness",
                   help="attention with CP: the harness's own (default) or TransformerEngine's DotProductAttention in "
                        "THD, handed each micro-batch's CP group (te: --cp-exchange te:p2p unless another te: type)")
    c.add_argument("--pp", type=T.STAGES, default=1, help="pipeline stages (the world is pp stages of a DP x CP domain)")
    c.add_argument("--tp", type=T.TP, default=1,
                   help="tensor-parallel ranks: each block's heads and FFN (an MoE's experts), and the vocabulary, "
                        "split over them (Megatron's TP); the world is pp x (DP x CP) x tp ranks, the reference unsplit")
    c.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp > 1: split the token rows between the blocks' matrices over the TP ranks too "
                        "(Megatron's --sequence-parallel; the split norms' and MoE routers' gradients summed over TP, "
                        "each TP rank's router routing its rows)")
    c.add_argument("--make-vocab-size-divisible-by", type=T.VOCAB_MULTIPLE, default=1, metavar="N",
                   help="with --tp > 1: pad the split vocabulary to a multiple of N x tp (Megatron's flag, 128 there; "
                        "the padding's logits masked out of the loss, so the run trains the unpadded model); default 1: "
                        "padded only where tp does not divide it")
    c.add_argument("--loss-chunk", type=T.LOSS_CHUNK, default=0, metavar="TOKENS",
                   help="run the LM head and its cross-entropy this many tokens at a time (a fused linear "
                        "cross-entropy: the logits never whole, their gradient formed chunk by chunk; the head's "
                        "matrix product runs twice); judged against a reference that computes them whole; default 0: "
                        "the whole logits at once")
    c.add_argument("--moe-aux-loss", type=T.AUX_COEF, default=None, metavar="COEF",
                   help="MoE models: the routers' sequence-level load-balancing loss with this coefficient (Megatron's "
                        "seq_aux_loss, e.g. 1e-2; each sequence balanced over its own tokens, its counts summed over "
                        "its CP block and, under --sequence-parallel, the TP ranks); default: none")
    c.add_argument("--vpp", type=T.CHUNKS, default=1, help="virtual chunks per stage (interleaved 1F1B when > 1)")
    c.add_argument("--pipeline", choices=["1f1b", "afab"], default="1f1b",
                   help="pipeline schedule (1f1b, or afab: all forwards, then all backwards)")
    c.add_argument("--schedule-delivery", choices=["broadcast", "compute"], default="broadcast",
                   help="dynamic-CP schedules: computed on the first stage and sent down (broadcast) or computed "
                        "by every stage (compute); the stages are checked to agree")
    c.add_argument("--ep", action="store_true",
                   help="expert parallelism (MoE models): shard the experts over each stage's DP x CP domain, "
                        "tokens dispatched to them by all-to-all; the dcp schedule is made for the synchronous "
                        "execution model (with --tp: each TP coordinate's domain, every expert split over TP; "
                        "needs --sequence-parallel)")
    c.add_argument("--weights", choices=["cached", "fused", "per-call"], default="cached",
                   help="how the layouts' steps take their matrix weights: cached (a compute-dtype copy made once per "
                        "step, gradients added into .grad in place; default), fused (the copies, and the weight-"
                        "gradient GEMM accumulating into .grad: within bf16 rounding) or per-call (autocast's cast at "
                        "each call, autograd's accumulation; the same numbers as cached). The reference runs per-call")
    c.add_argument("--optimizer", choices=["replicated", "distributed"], default="replicated",
                   help="replicated (every rank keeps the whole AdamW; default) or distributed (each DP x CP rank of a "
                        "stage keeps and updates 1/N of it: gradients reduce-scattered, parameters all-gathered, "
                        "Megatron's --use-distributed-optimizer; the same update). The reference runs replicated")
    c.add_argument("--token-bucket", type=T.TOKEN_BUCKET, default="auto",
                   help="pad every rank's micro-batch of the thd / dcp layouts to a multiple of this many tokens (even; "
                        "0 = off), or auto (default): 64 on CUDA when it divides --max-seqlen-per-rank, off on the "
                        "CPU, as bench step does: the padded step must still match bshd and the reference")
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
                   help="also train the reference (one rank: no CP, PP, TP or EP; harness.apps.reference) and judge every "
                        "layout against it: losses, gradient norms, step-1 gradients and token losses (default "
                        "run); off: without a golden the verdict is NO REFERENCE")
    c.add_argument("--fp32-probe", choices=["on", "off"], default="on",
                   help="bf16 runs: each layout and the reference also run step 1 in fp32 (update thrown away), its "
                        "step-1 gradients and token losses held to fp32's band (bf16's let a wrong RoPE offset "
                        "through); off: bf16's bands only")
    c.add_argument("--plant", metavar="FAULT", default=None,
                   help="run with a fault of the catalogue active on every rank (dcp-harness faults --list): "
                        "shows what the verdict says of that bug; it must FAIL")
    add_stall(c)
    add_nodes(c)


def run(a) -> int:
    from harness.apps import converge  # lazy: the CLI's own import stays light
    from harness.stack import checks  # lazy: as above

    if a.device == "auto":
        import torch  # heavy to import; only --device auto asks it for a GPU

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    nodes, local = nodes_from(a, a.world, a.device)
    if a.device == "cpu":
        T.check_cpu_ranks(local, "--world" if not nodes.multi else "--world / --nnodes")
    T.check_run_size(a.steps, a.batch_size or converge.DEFAULT_BATCH)
    if a.out is not None:
        T.writable_folder(a.out, "--out")
    if a.attention == "te" and not (a.cp_exchange or "").startswith("te:"):
        if a.cp_exchange:
            raise T.UsageError(f"--attention te runs TransformerEngine's CP exchange; --cp-exchange {a.cp_exchange} is the "
                               "harness's: drop it, or give te:p2p, te:all_gather or te:a2a")
        a.cp_exchange = "te:p2p"
    a.cp_exchange = a.cp_exchange or "gather"
    cfg = converge.config_from_args(a)
    res = converge.run(cfg, world=a.world, out_root=a.out or REPORTS,
                       golden="update" if a.update_golden else a.golden, stall_s=a.stall_timeout, plant=a.plant,
                       reference_mode=a.reference, nodes=nodes)
    if res is None:  # a node other than node 0 of a multi-node job
        return 0
    for c in res.checks:
        print(f"  [{checks.mark(c)}] {c['target']}" + ("" if c["value"] != c["value"] else f": {c['value']:.3g}"))
    print(f"report: {res.run_dir / 'index.html'}\nverdict: {res.verdict}")
    return 0 if res.verdict == "PASS" else 1
