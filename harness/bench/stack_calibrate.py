"""The cost model ``balanced`` schedules megatron-core's step with, measured on the stack itself.

megatron-core's hybrid-CP step runs every sequence of a group as its own forward and backward, on every rank of
the sequence's CP group; measured on 4 H200s with TE, each costs far more than its FLOPs (host launches and
synchronisations), so a schedule made for FLOPs alone - widening sequences to balance the ranks' tokens - runs
more sequences per rank and loses to megatron-core's own scheduler. ``calibration_batches`` are three global
batches at CP 1; ``fit_stack_cost`` reads from their step times a fixed cost per sequence and rank
(``CostModel.per_sequence``) and the achieved FLOP rate; ``stack_cost`` turns the model's FLOP cost into seconds
with both. ``bench step --stack megatron-core`` calibrates before its runs unless ``--no-calibrate`` (or a
fixed ``--cost-model``) is given.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

CALIBRATION_SHORT = 256
"""Tokens of the short sequences the stack's calibration times."""
CALIBRATION_COUNT = 3
"""The calibration's second batch gives every rank this many short sequences (its first, one)."""


def calibration_batches(world: int, mslpr: int) -> dict[str, list[int]]:
    """The global batches ``fit_stack_cost`` needs, each at CP 1 with the same count on every rank: one short
    sequence per rank, ``CALIBRATION_COUNT`` short ones per rank, one of ``mslpr`` tokens per rank."""
    short = min(CALIBRATION_SHORT, mslpr)
    return {"one_short": [short] * world, "more_short": [short] * (CALIBRATION_COUNT * world),
            "one_long": [mslpr] * world}


def calibration_time(stack, lengths, world, cfg, vocab, dev, reps: int = 3) -> float:
    """Median seconds (slowest rank) of ``reps`` steps of about ``lengths`` at static CP 1, after one untimed step.
    Each step shortens its sequences by a few tokens (at most 30) that change from step to step, so a step's shapes
    are not the last one's: a stack that prepares something per new shape pays it here as in a real step."""
    import torch
    import torch.distributed as dist

    from harness.stack.protocol import StepRequest
    from harness.train.layouts import LayoutConfig, plan

    sync = torch.cuda.synchronize if torch.device(dev).type == "cuda" else (lambda: None)
    lcfg = LayoutConfig(n_ranks=world, max_seqlen_per_rank=cfg.max_seqlen_per_rank, static_cp=1)
    rng = np.random.default_rng(cfg.seed + len(lengths))
    times = []
    for rep in range(reps + 1):
        these = [max(16, L - (i + rep * len(lengths) + 1) % 31) for i, L in enumerate(lengths)]
        sched, padding, fixed = plan("thd", these, lcfg)
        req = StepRequest(step=rep, layout="dcp", batch=[rng.integers(0, vocab, size=L + 1) for L in these],
                          schedule=sched, padding=padding, fixed_length=fixed, want=frozenset())
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        stack.step(req)
        sync()
        took = torch.tensor([time.perf_counter() - t0], device=dev)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    return statistics.median(times[1:])


def fit_stack_cost(times: dict[str, float], flops, mslpr: int) -> dict:
    """The stack's step as ``fixed + sequences per rank x per_sequence + FLOPs per rank / rate`` from the three
    ``calibration_batches`` times (seconds): the extra short sequences give ``per_sequence`` plus their compute,
    the long one against one short one gives the rate. ``flops``: the model's FLOP ``CostModel``. A rate the
    times cannot resolve (the long step no slower: compute lost in the overheads) is None. A time that is missing,
    not finite or not > 0 is a ``ValueError`` naming it (``max(0, nan)`` would otherwise price the stack at 0)."""
    for name in ("one_short", "more_short", "one_long"):
        t = times.get(name)
        if not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"the stack's calibration step '{name}' took {t!r} s: every calibration step must take a "
                             f"finite time > 0 (a failed or unsynchronised step?)")
    short = min(CALIBRATION_SHORT, mslpr)
    f_short, f_long = flops.seq_cost(short, 1), flops.seq_cost(mslpr, 1)
    each = (times["more_short"] - times["one_short"]) / (CALIBRATION_COUNT - 1)
    dt = times["one_long"] - times["one_short"]
    rate = (f_long - f_short) / dt if dt > 0 else None
    per_sequence = max(0.0, each - (f_short / rate if rate else 0.0))
    fixed = max(0.0, times["one_short"] - per_sequence - (f_short / rate if rate else 0.0))
    return {"times_s": dict(times), "per_sequence_s": per_sequence, "flops_per_s": rate, "fixed_s": fixed,
            "short_tokens": short}


def stack_cost(flops, fit: dict, peak: float | None):
    """``flops`` (the model's FLOP cost, with its K/V exchange) in seconds at the calibrated rate, plus the
    calibrated ``per_sequence``: what ``balanced`` schedules the stack with. An unresolved rate falls back to
    half the device's peak (the overheads dominate then anyway)."""
    from dataclasses import replace

    rate = fit["flops_per_s"] or 0.5 * (peak or 989.0) * 1e12
    return replace(flops, quadratic=flops.quadratic / rate, linear=flops.linear / rate,
                   constant=flops.constant / rate, cp_comm=flops.cp_comm / rate,
                   per_microbatch=flops.per_microbatch / rate, cp_block=flops.cp_block / rate,
                   per_sequence=fit["per_sequence_s"], name=f"{flops.name} on the stack, calibrated")


def calibration_line(fit: dict) -> str:
    rate = f"{fit['flops_per_s'] / 1e12:.0f} TFLOP/s per GPU" if fit["flops_per_s"] else "compute below the noise"
    return (f"calibrated the stack's step: {fit['per_sequence_s'] * 1e3:.1f} ms per sequence on each rank of its "
            f"group, {rate}, {fit['fixed_s'] * 1e3:.1f} ms per step (steps of 1 and {CALIBRATION_COUNT} "
            f"{fit['short_tokens']}-token sequences and 1 long one per rank: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in fit["times_s"].items()) + ")")
