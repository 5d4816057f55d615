"""``bench step``'s cost calibration: time a few micro-batch shapes per CP size on this machine and
fit the scheduler's ``CostModel`` to them, in seconds.

Without it ``balanced`` would optimise a FLOP model that does not know this machine's launch and
collective overheads; with it the step-time model's prediction is in milliseconds, next to the
measurement. The shapes and the fit are pure Python + numpy (tested without a world); only
``calibrate_cost`` runs on the ranks.
"""

from __future__ import annotations

import statistics
import time

from harness.bench.step.rank import RankContext, microbatch_runner, sync
from harness.plan import CostModel
from harness.plan.layout import Block, Schedule

CALIBRATION_TERMS = ("quadratic", "linear", "constant", "cp_comm", "per_microbatch", "cp_block")


def calibration_shapes(world: int, mslpr: int) -> list[tuple[int, list[int]]]:
    """(block size, sequence lengths) of the micro-batches timed by ``calibrate_cost``: per CP size
    a full and a half block of one sequence, and full blocks of 8 and 32 equal short ones, so the
    quadratic, linear, per-sequence, exchange and fixed terms separate."""
    out = []
    s = 1
    while s <= world:
        cap = s * mslpr
        out += [(s, [cap]), (s, [cap // 2]), (s, [cap // 8] * 8), (s, [max(1, cap // 32)] * 32)]
        s *= 2
    return out


def calibration_features(size: int, lengths: list[int]) -> list[float]:
    """Per-rank regressors of one block, in ``CALIBRATION_TERMS`` order (``CostModel.seq_cost``)."""
    return [sum(L * L for L in lengths) / size, sum(lengths) / size, len(lengths) / size,
            sum(lengths) * (size - 1) / size if size > 1 else 0.0, 1.0, 1.0 if size > 1 else 0.0]


def fit_cost(rows: list[list[float]], times: list[float]) -> tuple[dict, float]:
    """Non-negative least squares in relative error (rows weighted by 1/t): the exact solution over
    every subset of terms whose unconstrained fit is non-negative. Returns (coefficients by term,
    worst relative error)."""
    import itertools

    import numpy as np

    X, t = np.asarray(rows, dtype=np.float64), np.asarray(times, dtype=np.float64)
    if X.ndim != 2 or len(t) != X.shape[0] or (t <= 0).any():
        raise ValueError("fit_cost needs one positive time per row of regressors")
    W = X / t[:, None]
    best = None
    k = X.shape[1]
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            coef, *_ = np.linalg.lstsq(W[:, cols], np.ones(len(t)), rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(k)
            full[list(cols)] = coef
            err = float(np.max(np.abs(X @ full - t) / t))
            if best is None or err < best[1] - 1e-12:
                best = (full, err)
    coef, err = best
    return dict(zip(CALIBRATION_TERMS, coef.tolist())), err


def _round3(x: float) -> float:
    return float(f"{x:.3g}")


def calibrate_cost(ctx: RankContext) -> dict:
    """Time the forward + backward of each ``calibration_shapes`` micro-batch (every block of the
    world runs it ``calibration_burst`` times back to back; the slowest rank counts; median of
    ``calibration_reps``), fit ``CostModel``
    coefficients in seconds on rank 0 and broadcast them (every rank schedules with the same model)."""
    import torch
    import torch.distributed as dist

    cfg, dev, me = ctx.cfg, ctx.device, ctx.rank
    shapes = calibration_shapes(ctx.world, cfg.max_seqlen_per_rank)
    times = []
    for size, lengths in shapes:
        ctx.heartbeat.beat(phase="calibration", cp=size, sequences=len(lengths))
        times.append(_time_shape(ctx, size, lengths))
    with torch.no_grad():
        ctx.flat.zero_()
    own = torch.tensor(times, dtype=torch.float64, device=dev)
    gathered = [torch.zeros_like(own) for _ in range(ctx.world)]
    dist.all_gather(gathered, own, group=ctx.everyone)
    per_rank = [g.tolist() for g in gathered]
    t = torch.stack(gathered).amax(dim=0)
    rows = [calibration_features(size, lengths) for size, lengths in shapes]
    coef = torch.zeros(len(CALIBRATION_TERMS) + 1, dtype=torch.float64, device=dev)
    if me == 0:
        fitted, err = fit_cost(rows, t.tolist())
        coef[:-1] = torch.tensor([fitted[k] for k in CALIBRATION_TERMS], dtype=torch.float64)
        coef[-1] = err
    dist.broadcast(coef, src=0, group=ctx.everyone)
    c = coef.tolist()
    # three significant digits: run-to-run timing jitter below that does not change the schedules
    model = CostModel(**{k: _round3(max(0.0, v)) for k, v in zip(CALIBRATION_TERMS, c)}, name=f"calibrated {cfg.model}")
    return {"cost": model, "shapes": [{"cp": s, "lengths": L, "seconds": x,
                                       "predicted": sum(a * b for a, b in zip(calibration_features(s, L), c))}
                                      for (s, L), x in zip(shapes, t.tolist())],
            "max_rel_error": c[-1], "rank_seconds": per_rank, "rank_slowdown": rank_slowdown(shapes, per_rank)}


def rank_slowdown(shapes: list[tuple[int, list[int]]], per_rank: list[list[float]]) -> list[float] | None:
    """Each rank's time over the CP-1 shapes (every rank runs the same micro-batch alone, no CP collective to wait
    in) relative to the fastest rank's: 1.0 for the fastest, 1.08 for a rank 8% slower on the same work - a slow GPU
    or host that no schedule balances. None without CP-1 shapes."""
    ones = [k for k, (size, _) in enumerate(shapes) if size == 1]
    if not ones or not per_rank:
        return None
    totals = [sum(r[k] for k in ones) for r in per_rank]
    fastest = min(totals)
    return [x / fastest for x in totals] if fastest > 0 else None


def _time_shape(ctx: RankContext, size: int, lengths: list[int]) -> float:
    """This rank's median seconds per forward + backward of one micro-batch of ``lengths`` in a
    block of ``size`` ranks (every block of the world runs one), timed in bursts after one untimed burst."""
    import torch.distributed as dist

    # lazy: imports torch; the CLI imports this module without it
    from harness.parallel.reroute import build_microbatches, sample_for

    cfg, dev, n, me = ctx.cfg, ctx.device, ctx.world, ctx.rank
    k = len(lengths)
    gids = list(range(n // size * k))
    blocks = [Block(b * size, size, tuple(gids[b * k:(b + 1) * k])) for b in range(n // size)]
    sched = Schedule.from_blocks([blocks], lengths=[(g, lengths[g % k]) for g in gids], n_ranks=n,
                                 max_seqlen_per_rank=cfg.max_seqlen_per_rank, algorithm="calibration")
    mine = next(b for b in blocks if b.start <= me < b.start + size)
    samples = {g: sample_for(g, lengths[g % k], vocab=ctx.model.c.vocab, device=dev) for g in mine.gids}
    (mb,) = build_microbatches(samples, sched, me, token_multiple=cfg.bucket())
    run = microbatch_runner(ctx, mb, float(sum(lengths)), cfg.cp_exchange)
    reps = []
    for r in range(cfg.calibration_reps + 1):
        dist.barrier(group=ctx.everyone)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(cfg.calibration_burst):
            run()
        sync(dev)
        if r:
            reps.append((time.perf_counter() - t0) / cfg.calibration_burst)
    return statistics.median(reps)
