"""The runs that exercise the faults, each with and without its fault, and how they are judged.

- ``train`` / ``train-small-batch``: tiny GPT, 4 gloo ranks, 2 steps, 128 tokens per rank, so that
  every step mixes CP blocks of 1, 2 and 4 ranks (16 sequences a batch; the small batch has 3
  sequences of 200-400 tokens, fewer than the ranks). The clean run trains bshd and dcp; a fault run
  trains dcp only, with the fault active on every rank, and is judged against the clean bshd run.
- ``train-pp-mtp``: multi-token prediction under 2 pipeline stages of 2 ranks and the distributed optimiser: the MTP
  block on the last stage looks its tokens up in a replica of the first stage's embedding
  (``harness.train.shared_embedding``).
- ``train-ep``: the ``train`` run with the tiny MoE under expert parallelism (one expert per rank).
- ``train-tp``: the ``train`` run of the MTP model with tensor parallelism: 2 TP ranks per position of a 2-rank DP x CP
  domain (``harness.parallel.tensor_parallel``, the vocabulary by ``harness.parallel.vocab_parallel``); the probes hold
  whole gradients, gathered from the shards.
- ``train-tp-moe``: the tiny MoE with 2 TP ranks a position: every expert's FFN split, the router replicated.
- ``train-tp-dist-opt``: ``train-tp`` with the distributed optimiser (``harness.parallel.dist_opt``).
- ``train-sp``: the tiny MoE with 2 TP ranks a position and sequence parallelism
  (``harness.parallel.sequence_parallel``): between the blocks' matrices each TP rank holds half of its position's
  token rows, each TP rank's router routes its half, the experts (each FFN split over TP) run on both halves; one step.
- ``train-bucketed``: the ``train`` run with every thd / dcp micro-batch padded to a multiple of 16 tokens per rank
  (``bench step``'s token bucket, its default on CUDA): the padded step must still match the clean bshd run.
- ``train-bf16``: the ``train`` run in bf16 for one step; each layout runs step 1 in fp32 first (the probe step of
  ``TrainConfig.fp32_probe``). Judged by ``BF16_CHECKS``: the fp32 step against the clean bshd run's fp32 step, and
  each run's bf16 step 1 against its own fp32 step 1.
- ``verify-bf16``: what ``dcp-harness verify harness`` runs (the stack driver, ``harness.stack.drive``) on 2 gloo ranks in
  bf16, the dcp layout's step 1 (8 sequences, CP blocks of 1 and 2) and its sharp step 1
  (``harness.stack.checks.SHARP_SCALE``), and the one-rank reference; judged by ``harness.stack.checks``: every failing
  line is an alarm, ``sharp-took-effect`` for the sharp step's own line, ``verify-checks`` for the rest.
- ``replay``: router replay under PP 2 (2 virtual chunks a stage, interleaved) x CP 2
  (``harness.train.replay.replay_check``).
- ``replay-sp``: router replay under CP 2 x TP 2 with sequence parallelism: each TP rank's router replays its block of
  its CP rank's rows.
- ``plan``: PR #2000's scheduler on the input that triggers the vacuous room check (N = 10,
  [8000, 7000] at 2048 tokens per rank), run as upstream's driver runs it, and ``balanced`` under the
  synchronous model (the rows by levels) on a batch whose 2-rank blocks fill up; judged by ``check_schedule``.
- ``stepwise``: a contiguous and an interleaved step-wise batch through validation and the advantage
  broadcast; judged against each row's own trajectory (by id).
A scenario returns ``(alarms, observations)``; an in-run alarm ends the run where it fired.
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from harness.faults.catalogue import get
from harness.faults.checks import BF16_CHECKS, TOLERANCES, TRAIN_CHECKS, Alarm
from harness.faults.seam import replaced
from harness.jobs.launch import RankFailure, run_on_ranks
from harness.parallel.audit import GroupAuditError
from harness.parallel.expert_parallel import DispatchAuditError
from harness.plan import CostModel, ScheduleError, gpt_benchmark_cost, schedule, schedule_lower_bound, simulate
from harness.plan.generator_output import GeneratorOutputError, validate_generator_output
from harness.plan.layout import Schedule, layout_from_sizes
from harness.plan.megatron_pr2000 import schedule_pr2000
from harness.plan.padding import SequencePadding
from harness.plan.pipeline_schedule import PipelineScheduleError
from harness.plan.stepwise import broadcast_step_advantages
from harness.plan.validate import check_schedule
from harness.train.pipeline import ScheduleAgreementError
from harness.train.replay import replay_check
from harness.train.trainer import train

WORLD = 4
TRAIN = {"model": "tiny-gpt", "steps": 1, "max_seqlen_per_rank": 128, "scheduler": "megatron-dev", "probes": True,
         "corpus": {"sequences_per_batch": 16}}
"""The scenarios' run: one step, where every fault of the scenarios built on it shows (step 1's gradients and losses,
the replicas after step 1's update, the groups and schedules of step 1's micro-batches)."""
TRAIN_CONFIGS = {"train": {**TRAIN, "steps": 2},  # 2 steps: adam-eps-underflow and weight-copy-never-refreshed show
                 # in step 2 only (step 1's update read by step 2: NaN rows; weight copies never made again)
                 "train-small-batch": {**TRAIN, "corpus": {"sequences_per_batch": 3,
                                                           "lengths": "uniform:min=200,max=400"}},
                 # 2 stages of a 2-rank DP x CP domain; every stage plans the batch itself (cost-aware balanced)
                 "train-pp": {**TRAIN, "pp": 2, "max_seqlen_per_rank": 256, "scheduler": "balanced",
                              "schedule_delivery": "compute"},
                 # 2 stages x 2 virtual chunks, PR #2000's scheduler aligned to the interleaved group
                 "train-pp-vpp": {**TRAIN, "pp": 2, "vpp": 2, "max_seqlen_per_rank": 256,
                                  "scheduler": "megatron-pr2000"},
                 # multi-token prediction (depth 1) and the Mamba-style hybrid "M*M-"
                 "train-mtp": {**TRAIN, "model": "tiny-gpt-mtp"},
                 # multi-token prediction on the last of 2 stages: its embedding a replica of the first stage's
                 # table; the distributed optimiser, whose reduce-scatter the replica's gradient must precede
                 "train-pp-mtp": {**TRAIN, "model": "tiny-gpt-mtp", "pp": 2, "max_seqlen_per_rank": 256,
                                  "scheduler": "balanced", "optimizer": "distributed"},
                 # the Mamba-style hybrid "M*M-" with 2 TP ranks per position of a 2-rank DP x CP domain: the mixers'
                 # heads split over TP, then over a CP block's ranks
                 "train-hybrid": {**TRAIN, "model": "tiny-hybrid", "tp": 2, "max_seqlen_per_rank": 256},
                 # two layouts in one run: the dynamic groups are destroyed and created again in between
                 "train-reinit": TRAIN,
                 # the tiny MoE with expert parallelism over the 4-rank domain (one expert per rank) and the routers'
                 # sequence-level balance loss (Megatron's default coefficient)
                 "train-ep": {**TRAIN, "model": "tiny-moe", "expert_parallel": True, "moe_aux_loss": 1e-2},
                 # the step's weight copies with the weight-gradient GEMM accumulating into .grad itself
                 "train-fused": {**TRAIN, "weights": "fused"},
                 # the distributed optimiser, its tiny-GPT buffers in 4 buckets of whole parameters
                 "train-dist-opt": {**TRAIN, "optimizer": "distributed", "grad_bucket_elements": 30_000},
                 # every rank's thd / dcp micro-batch padded to a multiple of 16 tokens (bench step's token bucket);
                 # the loss head over chunks of 48 tokens (the padding's losses carry no weight)
                 "train-bucketed": {**TRAIN, "token_bucket": 16, "loss_chunk": 48},
                 # CP blocks exchange heads for tokens (all-to-all); the tiny GPT's 2 K/V heads copied for CP 4
                 "train-a2a": {**TRAIN, "cp_exchange": "a2a"},
                 # 2 TP ranks per position (each block's heads and FFN, the vocabulary of the embedding and the
                 # head split) of a 2-rank DP x CP domain; multi-token prediction's block and combine too (the
                 # combine's gradients make the replicated parameters' share of the norm large enough to weigh)
                 # the vocabulary padded as Megatron pads it, to a multiple of 96 x tp: 256 -> 384 rows, the second TP
                 # rank's 192 ids 128 of them padding
                 "train-tp": {**TRAIN, "model": "tiny-gpt-mtp", "tp": 2, "max_seqlen_per_rank": 256,
                              "make_vocab_size_divisible_by": 96},
                 # the tiny MoE with 2 TP ranks: each expert's FFN split, the router replicated (expert TP); the
                 # loss head over chunks of 48 tokens of each TP rank's vocabulary shard
                 "train-tp-moe": {**TRAIN, "model": "tiny-moe", "tp": 2, "max_seqlen_per_rank": 256,
                                  "loss_chunk": 48},
                 # the same with the distributed optimiser: each TP coordinate's DP x CP ranks shard its AdamW,
                 # split and replicated parameters sharing buckets of 30,000 elements
                 "train-tp-dist-opt": {**TRAIN, "model": "tiny-gpt-mtp", "tp": 2, "max_seqlen_per_rank": 256,
                                       "optimizer": "distributed", "grad_bucket_elements": 30_000},
                 # sequence parallelism: the blocks' token rows split over the 2 TP ranks too, the tiny MoE (a dense
                 # block, then MoE blocks whose routers route each TP rank's rows, their balance counts summed over TP
                 # too); one step (its faults show in step 1's gradients or in the replicas after step 1's update)
                 "train-sp": {**TRAIN, "model": "tiny-moe", "tp": 2, "sequence_parallel": True,
                              "max_seqlen_per_rank": 256, "steps": 1, "moe_aux_loss": 1e-2},
                 # expert parallelism with tensor and sequence parallelism: the tiny MoE's experts over each TP
                 # coordinate's 2-rank domain, every expert's FFN split over the 2 TP ranks; one step
                 "train-ep-tp": {**TRAIN, "model": "tiny-moe", "tp": 2, "sequence_parallel": True,
                                 "expert_parallel": True, "max_seqlen_per_rank": 256, "steps": 1},
                 # bf16, one step: each layout runs step 1 in fp32 first (the probe step), judged by BF16_CHECKS;
                 # corpus seed 3, as seed 4 (fp32-step-of-another-model's) also draws a batch that fits 4 x 128 tokens
                 "train-bf16": {**TRAIN, "dtype": "bfloat16", "steps": 1,
                                "corpus": {"sequences_per_batch": 16, "seed": 3}}}
FAULT_LAYOUTS = {"train-reinit": ["thd", "dcp"]}
"""The layouts a fault run trains (default: dcp only); the checks judge its dcp layout."""
REPLAY_CONFIGS = {"replay": {"pp": 2, "vpp": 2, "cp": 2}, "replay-sp": {"pp": 1, "cp": 2, "tp": 2, "sp": True}}
REPLAY = REPLAY_CONFIGS["replay"]
WORLD_TIMEOUT_S = 60.0


def _fault(name):
    return get(name).applied() if name else nullcontext()


def _train_run(rank: int, world: int, cfg: dict, fault: str | None) -> dict:
    """One train run on one rank: its rows and probes, or the in-run alarm every rank raised."""
    try:
        with _fault(fault), contextlib.redirect_stdout(io.StringIO()):  # no per-step lines
            out = train(rank, world, cfg)
    except ScheduleError as e:
        return {"alarm": Alarm("schedule-invariants", str(e), {"layout": getattr(e, "layout", None),
                                                              "step": getattr(e, "step", 0) + 1,
                                                              "microbatch": e.microbatch, "ranks": e.ranks}).to_dict()}
    except GroupAuditError as e:
        return {"alarm": Alarm("group-audit", str(e), {"layout": getattr(e, "layout", None),
                                                      "step": getattr(e, "step", 0) + 1, "microbatch": e.microbatch,
                                                      "rank": e.rank}).to_dict()}
    except ScheduleAgreementError as e:
        return {"alarm": Alarm("schedule-agreement", str(e), {"layout": getattr(e, "layout", None),
                                                             "step": getattr(e, "step", 0) + 1, "stage": e.stage,
                                                             "microbatch": e.microbatch}).to_dict()}
    except DispatchAuditError as e:
        return {"alarm": Alarm("expert-dispatch", str(e), {"layout": getattr(e, "layout", None),
                                                          "step": getattr(e, "step", 0) + 1, "layer": e.layer,
                                                          "rank": e.sender}).to_dict()}
    except PipelineScheduleError as e:
        return {"alarm": Alarm("pipeline-schedule", str(e), {"layout": getattr(e, "layout", None),
                                                            "step": getattr(e, "step", 0) + 1}).to_dict()}
    return {"rows": out["layouts"], "probes": out["probes"]}


def _replay_run(rank: int, world: int, cfg: dict, fault: str | None) -> dict:
    with _fault(fault):
        return replay_check(rank, world, cfg)


def batch_world(rank: int, world: int, spec: dict) -> list[dict]:
    """One rank of a world that runs ``spec["runs"]`` (fault names; None = clean) one after the other.
    In-run alarms are raised alike on every rank, so the world goes on to the next run; any other
    error ends the world (the caller then runs the faults one world each)."""
    import time

    scenario, out = spec["scenario"], []
    for fault in spec["runs"]:
        t = time.perf_counter()
        if scenario in REPLAY_CONFIGS:
            res = _replay_run(rank, world, REPLAY_CONFIGS[scenario], fault)
        else:
            layouts = ["bshd", "dcp"] if fault is None else FAULT_LAYOUTS.get(scenario, ["dcp"])
            res = _train_run(rank, world, {**TRAIN_CONFIGS[scenario], "layouts": layouts}, fault)
        out.append({**res, "seconds": time.perf_counter() - t})
    return out


def _world(fn, spec, workdir):
    return run_on_ranks(fn, world_size=WORLD, tmp_path=workdir, args=(spec,), timeout_s=WORLD_TIMEOUT_S)


def _in_run(ranks: list[dict]) -> list[Alarm]:
    alarms = [r["alarm"] for r in ranks if r.get("alarm")]
    if not alarms:
        return []
    a = alarms[0]
    return [Alarm(a["check"], a["message"], a["where"])]


def checks_of(scenario: str) -> dict:
    """The checks that judge a train scenario's runs: a bf16 run's are its fp32 step's (``BF16_CHECKS``)."""
    return BF16_CHECKS if TRAIN_CONFIGS[scenario].get("dtype") == "bfloat16" else TRAIN_CHECKS


def judge_train(ref: list[dict], ranks: list[dict], layout: str = "dcp", checks: dict = TRAIN_CHECKS) -> list[Alarm]:
    alarms = _in_run(ranks)
    if alarms:
        return alarms
    return [a for check in checks.values() if (a := check(ref, ranks, layout))]


def judge_replay(ranks: list[dict]) -> list[Alarm]:
    alarms = []
    bad = [(r["rank"], r["replay_mismatches"]) for r in ranks if r["replay_mismatches"]]
    if bad:
        n, total = sum(b[1] for b in bad), sum(r["tokens_checked"] for r in ranks)
        alarms.append(Alarm("replay-routes", f"{n} of {total} (token, layer) checks: tokens replayed other experts "
                            f"than the rollout chose (first: rank {bad[0][0]}, {bad[0][1]} tokens)",
                            {"rank": bad[0][0], "tokens": n}))
    worst = max(((v, r["rank"], name) for r in ranks for name, v in r["grad_rel"].items()), default=(0.0, 0, ""))
    tol = TOLERANCES["replay-gradients"]
    if worst[0] > tol:
        alarms.append(Alarm("replay-gradients", f"replayed gradient of {worst[2]} on rank {worst[1]} differs from the "
                            f"single-process reference by {worst[0]:.3g} relative (> {tol:g})",
                            {"rank": worst[1], "parameter": worst[2]}, worst[0], tol))
    return alarms


def _failure_line(e) -> str:
    """'rank r: <the last line of its traceback>' of the rank that failed first."""
    rep = e.reports[e.rank]
    last = rep.traceback.strip().splitlines()[-1] if rep.traceback else str(e).splitlines()[0]
    return f"rank {e.rank}: {last[:300]}"


def run_batch(scenario: str, faults: list[str], workdir) -> dict:
    """The clean run and then every fault of a world scenario (``train``, ``train-small-batch``,
    ``replay``), in one world (one start-up). If that world dies (a fault
    that breaks it in a way no check anticipates), every run goes again in a world of its own.
    Returns ``{None: clean outcome, name: outcome}``, an outcome being ``{"alarms", "seconds", "error"}``."""
    runs = [None, *faults]
    try:
        per_rank = _world(batch_world, {"scenario": scenario, "runs": runs}, workdir)
        results = [[r[i] for r in per_rank] for i in range(len(runs))]
        errors = [None] * len(runs)
    except RankFailure:
        results, errors = [], []
        for fault in runs:
            try:
                results.append([r[0] for r in _world(batch_world, {"scenario": scenario, "runs": [fault]}, workdir)])
                errors.append(None)
            except RankFailure as e:
                results.append(None)
                errors.append(_failure_line(e))
    ref = results[0]
    out = {}
    for fault, ranks, err in zip(runs, results, errors):
        if ranks is None or (ref is None and scenario not in REPLAY_CONFIGS):
            out[fault] = {"alarms": [], "seconds": 0.0, "error": err or "the clean run failed"}
            continue
        alarms = judge_replay(ranks) if scenario in REPLAY_CONFIGS else judge_train(ref, ranks,
                                                                                    checks=checks_of(scenario))
        out[fault] = {"alarms": alarms, "seconds": max(r["seconds"] for r in ranks), "error": None}
    return out


# --------------------------------------------------------------------------------------- plan
PLAN_TRIGGER = {"lengths": [8000, 7000], "n_ranks": 10, "max_seqlen_per_rank": 2048}


LEVELS_TRIGGER = {"lengths": [400, 3000, 400, 3000, 900, 300, 900, 2200, 900, 400, 2600, 400, 2200, 2200, 2600, 200,
                              400, 2200, 400, 200, 2200, 2200, 1500], "n_ranks": 8, "max_seqlen_per_rank": 2048}
"""A batch where ``balanced``'s levels put two sequences of 2-rank size side by side in one block when its room is
not checked (under the GPT cost, synchronous model)."""


TALL_TRIGGER = {"lengths": [329, 1597, 1011, 985, 3769, 64, 130, 64, 283, 1487, 322, 699, 64, 414, 85, 4767],
                "n_ranks": 4, "max_seqlen_per_rank": 2048}
"""A batch ``balanced`` leads with one tall micro-batch under the synchronous model (GPT cost), where a long
sequence joins a full block when the tall packer does not check its room."""

PER_SEQUENCE_TRIGGER = {"lengths": [5000, 3000, 900, 700, 600, 300, 200, 150], "n_ranks": 4,
                        "max_seqlen_per_rank": 2048}
"""Megatron's batch size (8 sequences on 4 ranks), two of them needing CP > 1, under the GPT cost with a fixed cost
per sequence and rank of 40 times a 1K-token sequence's FLOPs (megatron-core's step measured on 4 x H200)."""

STACK_TRIGGER = {"lengths": [5000, 3000, 900, 700, 600, 300, 200, 150, 1800, 1200, 400, 128], "n_ranks": 4,
                 "max_seqlen_per_rank": 2048, "microbatch_tokens_per_rank": 16384}
"""megatron-core's stack: a micro-batch holds any number of sequences per rank, each bounded by
``max_seqlen_per_rank`` (two of them need CP > 1); the GPT cost with a fixed cost per sequence and rank."""

SHELF_TRIGGER = {"lengths": [4000, 2100, 2000, 500, 300], "n_ranks": 4, "max_seqlen_per_rank": 2048}
"""Two sequences of 2-rank size, one much shorter than the other, and a narrow one (2000 tokens) that fits the
shorter block's slack but not its room (1996 tokens a block): the shelves' top-up must leave it out."""

PADDING_TRIGGER = {"lengths": [81] * 24, "n_ranks": 4, "max_seqlen_per_rank": 256, "tp": 8}
"""Sequence parallelism at tp 8: three 81-token sequences fit a rank's 256 tokens raw (243), but padded to 88 they
take 264; ``balanced`` (both models) and ``dp-balanced`` schedule it with the padding priced."""

TALLEST_TRIGGER = {"lengths": [40, 6, 6, 6, 6], "n_ranks": 2, "max_seqlen_per_rank": 64}
"""One long sequence beside short ones (L**2 plus a K/V exchange of 10 per token): the best schedule runs it on
both ranks (step 1072); a bound that keeps it on one rank says 1600."""


VERIFY = {"steps": 1, "dtype": "bfloat16", "max_seqlen_per_rank": 64, "layouts": ["dcp"],
          "corpus": {"lengths": "lognormal:mean=48,sigma=0.8,min=8,max=200", "sequences_per_batch": 8, "vocab": 64}}
"""The ``verify-bf16`` run (``suites/stack``'s bf16 case): 8 sequences up to 99 tokens on 2 ranks of 64 tokens."""


def _stack_rank(rank: int, world: int, spec: dict):
    """One rank of the stack driver (``harness.stack.drive.job``, what ``verify`` runs) with ``spec["fault"]``."""
    from harness.stack.drive import job  # lazy: the stack protocol's driver

    with _fault(spec["fault"]):
        return job(rank, world, spec["cfg"])


def _stack_reports(cfg, world: int, fault: str | None, folder) -> list[dict]:
    from harness.stack.checks import SHARP_SCALE
    from harness.stack.drive import load_reports  # lazy: as above

    job_cfg = {**cfg.to_dict(), "stack": "harness", "options": {}, "inline": True, "sharp_scale": SHARP_SCALE}
    return load_reports(run_on_ranks(_stack_rank, world_size=world, tmp_path=folder,
                                     args=({"fault": fault, "cfg": job_cfg},), timeout_s=WORLD_TIMEOUT_S))


def run_verify(fault: str | None, workdir=None) -> list[Alarm]:
    """What ``verify harness`` runs and judges, in bf16 on 2 forked gloo ranks and its one-rank reference, with
    ``fault`` active on every rank of both: each failing line of ``harness.stack.checks`` is an alarm
    (``sharp-took-effect`` for the sharp step's own line, ``verify-checks`` for the others)."""
    from harness.stack import checks
    from harness.stack.drive import reference_config  # lazy: the stack protocol's driver
    from harness.train.config import TrainConfig

    cfg = TrainConfig.from_dict(VERIFY)
    folder = Path(workdir or tempfile.mkdtemp(prefix="dcp-faults-")) / f"verify-{fault or 'clean'}"
    got = _stack_reports(cfg, 2, fault, folder / "layouts")
    ref = _stack_reports(reference_config(cfg, checks.REF_LAYOUT), 1, fault, folder / "reference")[0]["layouts"][checks.REF_LAYOUT]
    per_rank = [g["layouts"]["dcp"] for g in got]
    steps = [[pr["reports"][k] for pr in per_rank] for k in range(cfg.steps)]
    who = "reference (1 rank, no CP)"
    lines = [checks.sharp_took_effect(ref["reports"][0], ref["sharp"], checks.SHARP_SCALE),
             *checks.against_reference("dcp", steps, [[r] for r in ref["reports"]], cfg.dtype, who, cfg.model),
             *checks.sharp_against_reference("dcp", [pr["sharp"] for pr in per_rank], ref["sharp"], cfg.dtype, who,
                                             checks.SHARP_SCALE)]
    alarms = []
    for c in lines:
        if not c["pass"]:
            sharp = c.get("exercise", False)
            alarms.append(Alarm("sharp-took-effect" if sharp else "verify-checks", f"{c['target']}: {c['value']:.3g}",
                                {}, observed=None if sharp else c["value"], tolerance=None if sharp else c.get("limit")))
    return alarms


def run_plan(fault: str | None, workdir=None) -> list[Alarm]:
    """PR #2000's driver on its trigger input (a refusal, an error before any schedule exists, is the correct
    outcome there), then ``balanced`` under the synchronous model on ``LEVELS_TRIGGER``, ``TALL_TRIGGER``,
    ``TALLEST_TRIGGER`` and ``STACK_TRIGGER`` (a micro-batch capacity above ``max_seqlen_per_rank``), the rows by
    levels and by shelves, and ``balanced`` and ``dp-balanced`` on ``PADDING_TRIGGER`` (sequence parallelism's
    padding); an invalid schedule, or one faster than its batch's lower bound, is an alarm."""
    t = PLAN_TRIGGER
    pairs = list(enumerate(t["lengths"]))
    scheds = []
    with _fault(fault):
        try:
            mbs = schedule_pr2000(pairs, t["n_ranks"], t["max_seqlen_per_rank"])
            scheds.append(Schedule([layout_from_sizes(mb) for mb in mbs], dict(pairs), t["n_ranks"],
                                   t["max_seqlen_per_rank"]))
        except (AssertionError, ValueError):
            pass
        bounded = []
        flops = gpt_benchmark_cost()
        for t, cost in ((LEVELS_TRIGGER, flops), (TALL_TRIGGER, flops),
                        (TALLEST_TRIGGER, CostModel(quadratic=1.0, cp_comm=10.0)),
                        (STACK_TRIGGER, replace(flops, per_sequence=40 * flops.seq_cost(1024, 1)))):
            s = schedule(t["lengths"], n_ranks=t["n_ranks"], max_seqlen_per_rank=t["max_seqlen_per_rank"], cost=cost,
                         execution="synchronous", microbatch_tokens_per_rank=t.get("microbatch_tokens_per_rank"))
            scheds.append(s)
            bounded.append((s, simulate(s).step_time, schedule_lower_bound(s)))
        scheds += _level_candidates(LEVELS_TRIGGER, flops) + _shelf_candidates(SHELF_TRIGGER, flops)
        t = PADDING_TRIGGER
        scheds += [schedule(t["lengths"], n_ranks=t["n_ranks"], max_seqlen_per_rank=t["max_seqlen_per_rank"],
                            algorithm=a, execution=ex, padding=SequencePadding(tp=t["tp"]))
                   for a, ex in (("balanced", "independent"), ("balanced", "synchronous"), ("dp-balanced", None))]
    for sched in scheds:
        bad = check_schedule(sched)
        if bad:
            return [Alarm("schedule-invariants", str(bad[0].error()) + f" ({len(bad)} violations)",
                          {"microbatch": bad[0].microbatch, "ranks": list(bad[0].ranks)})]
    for sched, step, bound in bounded:
        if step < bound * (1 - 1e-9):
            return [Alarm("bound-soundness", f"a {len(sched.lengths)}-sequence schedule on {sched.n_ranks} ranks runs "
                                             f"in {step:.6g}, below the lower bound {bound:.6g} of its batch "
                                             f"({sched.execution.describe()})",
                          {"step_time": step, "lower_bound": bound}, observed=bound / step)]
    return _prediction_alarm(fault)


def _level_candidates(t: dict, cost) -> list[Schedule]:
    """``balanced``'s rows by levels for batch ``t`` as schedules, whether or not ``balanced`` picks one (another kind
    of candidate may win there): each must be valid on its own."""
    from harness.plan.balanced.candidates import by_levels
    from harness.plan.balanced.items import Item
    from harness.plan.cost import cp_min

    n, mslpr = t["n_ranks"], t["max_seqlen_per_rank"]
    items = [Item(g, L, cp_min(L, mslpr), cost) for g, L in enumerate(t["lengths"])]
    return [Schedule(tuple(layout_from_sizes(r) for r in rows), dict(enumerate(t["lengths"])), n, mslpr)
            for rows in by_levels(items, n, mslpr, 1, cost)]


def _shelf_candidates(t: dict, cost) -> list[Schedule]:
    """``balanced``'s rows by shelves for batch ``t`` as a schedule (valid whether or not ``balanced`` picks it)."""
    from harness.plan.balanced.items import Item
    from harness.plan.balanced.shelves import shelf_rows
    from harness.plan.cost import cp_min

    n, mslpr = t["n_ranks"], t["max_seqlen_per_rank"]
    items = [Item(g, L, cp_min(L, mslpr), cost) for g, L in enumerate(t["lengths"])]
    rows = shelf_rows(items, n, mslpr, 1, cost)
    return [Schedule(tuple(layout_from_sizes(r) for r in rows), dict(enumerate(t["lengths"])), n, mslpr)] if rows else []


def _prediction_alarm(fault: str | None) -> list[Alarm]:
    """``balanced``'s own prediction for its schedule of ``PER_SEQUENCE_TRIGGER`` against the simulator's step time."""
    from dataclasses import replace

    from harness.plan.balanced import plan_balanced
    from harness.plan.execution import resolve_execution

    t, flops = PER_SEQUENCE_TRIGGER, gpt_benchmark_cost()
    cost = replace(flops, per_sequence=40 * flops.seq_cost(1024, 1))
    with _fault(fault):
        _, predicted = plan_balanced(list(enumerate(t["lengths"])), t["n_ranks"], t["max_seqlen_per_rank"], 1, None,
                                     cost, resolve_execution("synchronous"))
        s = schedule(t["lengths"], n_ranks=t["n_ranks"], max_seqlen_per_rank=t["max_seqlen_per_rank"], cost=cost,
                     execution="synchronous")
    step = simulate(s).step_time
    if not (math.isfinite(predicted) and math.isfinite(step) and abs(predicted - step) <= 1e-9 * step):  # NaN, inf fire
        return [Alarm("prediction-agreement", f"for its schedule of {len(t['lengths'])} sequences on {t['n_ranks']} "
                                              f"ranks balanced predicts {predicted:.6g}, the simulator says {step:.6g} "
                                              f"under the same cost (a fixed cost per sequence and rank)",
                      {"predicted": float(f"{predicted:.4g}"), "simulated": float(f"{step:.4g}")},
                      observed=abs(predicted - step) / step, tolerance=1e-9)]
    return []


# ----------------------------------------------------------------------------------- stepwise
def _stepwise_batch(order: list[tuple[str, int, bool]]) -> dict:
    n = len(order)
    return {"prompt_token_ids": [[1, 2]] * n, "response_ids": [[3, 4, 5]] * n, "loss_masks": [[1, 1, 1]] * n,
            "rewards": [[0.0, 0.0, 0.0]] * n, "trajectory_ids": [t for t, _, _ in order],
            "is_last_step": [last for _, _, last in order]}


STEPWISE = {"values": {"A": 2.0, "B": -1.0, "C": 0.5},
            "contiguous": [("A", 0, False), ("A", 1, True), ("B", 0, False), ("B", 1, False), ("B", 2, True),
                           ("C", 0, True)],
            "interleaved": [("A", 0, False), ("B", 0, False), ("A", 1, True), ("B", 1, False), ("C", 0, True),
                            ("B", 2, True)]}


def run_stepwise(fault: str | None, workdir=None) -> list[Alarm]:
    """Validation, then the broadcast of each trajectory's advantage (given per last-step row, in
    order) to its steps; every row must carry its own trajectory's value or the batch be refused."""
    import numpy as np

    values, alarms = STEPWISE["values"], []
    with _fault(fault):
        for kind in ("contiguous", "interleaved"):
            order = STEPWISE[kind]
            out = _stepwise_batch(order)
            try:
                validate_generator_output(len({t for t, _, _ in order}), out, step_wise=True)
            except GeneratorOutputError:
                continue  # refused: nothing was trained on it
            last_vals = [values[t] for t, _, last in order if last]
            adv = broadcast_step_advantages(last_vals, out["is_last_step"], np.ones((len(order), 3)))[:, 0]
            wrong = [(i, t, float(adv[i])) for i, (t, _, _) in enumerate(order) if adv[i] != values[t]]
            if wrong:
                i, t, got = wrong[0]
                alarms.append(Alarm("stepwise-advantages", f"{kind} batch: {len(wrong)} of {len(order)} steps carry "
                                    f"another trajectory's advantage (row {i}, trajectory {t!r}: {got:g}, its own "
                                    f"{values[t]:g})", {"batch": kind, "row": i, "rows": len(wrong)}))
    return alarms


# --------------------------------------------------------------------------- seam self-test
def passthrough_world(rank: int, world: int, spec: dict) -> dict:
    """The catalogue's self-test: every seam in ``spec["seams"]`` replaced by a pass-through that
    counts its calls, then a ``train`` (``spec["cfg"]``) or ``replay`` run. A seam that is never
    called is dead (its faults would change nothing); a pass-through must not change the result. With
    ``spec["clean"]`` the same run goes first without pass-throughs (returned as ``clean``)."""
    counts: dict[str, int] = {}
    run = _replay_run if spec["kind"] == "replay" else _train_run
    clean = run(rank, world, spec["cfg"], None) if spec.get("clean") else None

    def counting(seam):
        def make(original):
            def passthrough(*args, **kwargs):
                counts[seam] = counts.get(seam, 0) + 1
                return original(*args, **kwargs)
            return passthrough
        return make

    with contextlib.ExitStack() as stack:
        for seam in spec["seams"]:
            stack.enter_context(replaced(seam, counting(seam), label="pass-through"))
        out = run(rank, world, spec["cfg"], None)
    return {"counts": counts, "out": out, "clean": clean}


def workdir():
    return tempfile.mkdtemp(prefix="dcp-faults-")
