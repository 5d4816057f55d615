"""``dcp-harness verify STACK``: check a training stack (the harness's runtime, or your own) through the stack
protocol: token accounting, CP groups, and losses, gradient norms, step-1 gradients and token losses against the
same stack on one rank without CP."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from harness import cli_types as T
from harness.commands.common import add_stall
from harness.data.corpus import CorpusConfig
from harness.paths import REPORTS

NAME = "verify"
HELP = "check a training stack (harness, megatron-core, or path/to/file.py:make) against its one-rank run"
DESCRIPTION = ("Run STACK's steps through the stack protocol (harness.stack) on --world ranks and on one rank "
               "without CP, and check them. STACK: 'harness' (the harness's runtime), 'megatron-core' (megatron-core's own "
               "hybrid CP with TransformerEngine; GPUs), 'path/to/file.py:make' or "
               "'package.module:make' (make(ctx, **options) returns a harness.stack.Stack).")


def add_arguments(c) -> None:
    c.add_argument("stack", help="harness, megatron-core, path/to/file.py:make or package.module:make")
    c.add_argument("--world", type=T.WORLD, default=4, help="ranks of the DP x CP domain (a power of two)")
    c.add_argument("--steps", type=T.STEPS, default=3)
    c.add_argument("--layouts", default="bshd,thd,dcp", help="comma-separated: bshd, thd, dcp")
    c.add_argument("--scheduler", default="balanced", help="dynamic-CP scheduler for the dcp layout")
    c.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: float32 on CPU, bfloat16 on GPU")
    c.add_argument("--lengths", default=None, help="length spec of the corpus (harness.data.workloads)")
    c.add_argument("--batch-size", type=T.BATCH_SIZE, default=None, help="sequences per global batch (default 32)")
    c.add_argument("--vocab", type=T.BATCH_SIZE, default=None, help="corpus vocabulary (default 256)")
    c.add_argument("--max-seqlen-per-rank", type=T.TOKENS, default=None)
    c.add_argument("--seed", type=T.SEED, default=None,
                   help=f"corpus and model seed, 0 to {T.MAX_SEED} (default: the first from 0 whose step 1 has a "
                        "sequence longer than the tokens per rank, so the dcp layout's step-1 checks see CP > 1)")
    c.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to the stack's factory as make(ctx, KEY=VALUE) (VALUE read as JSON when it parses, "
                        "else as text); repeatable")
    c.add_argument("--plant", metavar="FAULT", default=None,
                   help="the stack 'harness' only: run with a fault of the catalogue active on every rank "
                        "(dcp-harness faults --list); the verdict must be FAIL")
    c.add_argument("--golden", choices=["auto", "require", "off"], default="auto",
                   help="hold the loss and gradient-norm curves to golden/verify/<case>.<hw>.json: when it exists "
                        "(auto), always (require), never (off)")
    c.add_argument("--update-golden", action="store_true",
                   help="write this case's golden on this hardware from this run (its every check must pass)")
    c.add_argument("--sharp-scale", default="auto", metavar="auto|off|S",
                   help="bf16 runs check step 1 once more from a model whose query and key projections are scaled "
                        "by S (the stack's sharpen(S)), where position bugs stand out of bf16's rounding; auto: 16 in "
                        "bf16, off in fp32")
    c.add_argument("--out", type=Path, default=None, help="folder for verify.json (default reports/verify)")
    add_stall(c)


def options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise T.UsageError(f"--option {pair!r} is not KEY=VALUE with KEY a Python name; e.g. --option model=tiny-gpt")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run(a) -> int:
    from harness.apps import verify  # imports torch (~1 s): only the training commands pay for it
    from harness.stack import checks  # lazy: numpy and the stack protocol, as above
    from harness.stack.drive import load_factory  # lazy: torch, as above
    from harness.train.config import TrainConfig  # lazy: torch, as above

    opts = options(a.option)
    factory = load_factory(a.stack)  # a stack that cannot be found fails here, before any rank starts
    check = getattr(factory, "preflight", None)  # a factory may name what its stack needs (packages, devices)
    if callable(check):
        check(a.device, a.world)
    if a.device == "cpu":
        T.check_cpu_ranks(a.world, "--world")
    out = a.out or REPORTS / "verify"
    T.writable_folder(out, "--out")
    corpus = CorpusConfig(**{k: v for k, v in {"lengths": a.lengths, "sequences_per_batch": a.batch_size,
                                               "seed": a.seed, "vocab": a.vocab}.items() if v is not None})
    cfg = TrainConfig(layouts=tuple(x.strip() for x in a.layouts.split(",") if x.strip()), steps=a.steps,
                      scheduler=a.scheduler, device=a.device, corpus=corpus,
                      dtype=a.dtype or ("bfloat16" if a.device == "cuda" else "float32"),
                      **({"model": opts["model"]} if isinstance(opts.get("model"), str) else {}))
    if a.seed is None:  # the first seed whose step 1 needs CP > 1, so the dcp layout's step-1 checks see CP
        cfg = verify.exercising(cfg, a.world, a.max_seqlen_per_rank)
    else:
        cfg = replace(cfg, max_seqlen_per_rank=a.max_seqlen_per_rank or verify.default_max_seqlen(cfg, a.world))
    res = verify.verify(a.stack, cfg, world=a.world, out=out, options=opts, stall_s=a.stall_timeout, plant=a.plant,
                        golden="update" if a.update_golden else a.golden, sharp=a.sharp_scale)
    if res is None:  # a rank other than 0 of a world the user's launcher started
        return 0
    print(f"stack: {res.stack} ({a.stack}), {a.world} ranks, {a.steps} steps, {cfg.dtype}, corpus seed "
          f"{cfg.corpus.seed}, {cfg.max_seqlen_per_rank} tokens per rank")
    for c in res.checks:
        print(f"  [{checks.mark(c)}] {c['target']}: {c['value']:.3g}")
    for note in res.notes or []:
        print(f"  note: {note}")
    if res.golden:
        print(f"golden: {res.golden}")
    print(f"verdict: {res.verdict}  ({res.out / 'verify.json'})")
    return 0 if res.verdict == "PASS" else 1
