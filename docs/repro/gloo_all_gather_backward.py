"""torch.distributed.nn.functional.all_gather on gloo: a non-contiguous gradient comes back scrambled, silently.

Standalone (torch only, 2 CPU processes, gloo):

    python docs/repro/gloo_all_gather_backward.py

Each rank gathers ``x`` ([3, 4], float64) with the autograd all-gather and takes the same loss of the gathered
``y`` twice: once as ``(y * W).sum()`` (the gradient reaching the gather is contiguous) and once as
``(y.t() * W.t().contiguous()).sum()`` (the same loss; its gradient is ``W`` seen through a transpose:
non-contiguous). The
expected gradient of ``x`` on rank r is ``world * W[rows of r]`` (every rank's loss sees every row). Printed per
case: the largest deviation of ``x.grad`` from it, and ``dist.scatter`` into a transposed (non-contiguous) output,
the collective the gather's gloo backward is built on.

What it shows (torch 2.13.0+cpu, 2026-12-07): the contiguous case is exact, the transposed one is wrong (no error,
no warning), and ``dist.scatter`` writes a non-contiguous output in storage order, ignoring its strides; so does
``dist.all_to_all_single`` (which refuses a non-contiguous input but not a non-contiguous output). The
backward (``_AllGather.backward``, gloo branch) emulates a reduce-scatter with ``_AlltoAll``, whose gloo path scatters
into outputs made by ``torch.empty_like`` of the incoming gradients - which keep their strides. NCCL's branch goes
through ``_Reduce_Scatter``, which makes its buffers contiguous. Gloo's scatter ignoring strides is pytorch#24836 /
pytorch#192920; this is its consequence for the autograd collectives. ``docs/upstream-findings.md`` has the rest.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.nn.functional import all_gather

ROWS, COLS = 3, 4


def _gathered_gradient(rank: int, world: int, transposed: bool) -> float:
    x = (torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS) + 100 * rank).requires_grad_()
    y = torch.cat(all_gather(x))  # [world * ROWS, COLS]
    w = torch.arange(world * ROWS * COLS, dtype=torch.float64).reshape(world * ROWS, COLS)
    # equal losses, d loss / d y = w either way; through y.t() it reaches the gather as the transpose of a contiguous
    # [COLS, world * ROWS] tensor: non-contiguous
    loss = (y.t() * w.t().contiguous()).sum() if transposed else (y * w).sum()
    loss.backward()
    want = world * w[rank * ROWS:(rank + 1) * ROWS]
    return float((x.grad - want).abs().max())


def _scatter_into_transposed(rank: int, world: int) -> float:
    parts = [torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * r for r in range(world)]
    out = torch.empty(3, 2, dtype=torch.float64).t()  # [2, 3], non-contiguous
    dist.scatter(out, parts if rank == 0 else None, src=0)
    return float((out - parts[rank]).abs().max())


def _all_to_all_into_transposed(rank: int, world: int) -> float:
    rows = [torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * rank + 100 * dst for dst in range(world)]
    out = torch.empty(3, 2 * world, dtype=torch.float64).t()  # [2 * world, 3], non-contiguous
    dist.all_to_all_single(out, torch.cat(rows))
    want = torch.cat([torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * src + 100 * rank
                      for src in range(world)])
    return float((out - want).abs().max())


def _rank(rank: int, world: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    warnings.filterwarnings("ignore", message=".*all_gather is deprecated.*")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lines = [f"all_gather backward, contiguous gradient: max |x.grad - expected| = "
             f"{_gathered_gradient(rank, world, False):g}",
             f"all_gather backward, transposed gradient: max |x.grad - expected| = "
             f"{_gathered_gradient(rank, world, True):g}",
             f"dist.scatter into a transposed output: max |out - sent| = {_scatter_into_transposed(rank, world):g}",
             f"dist.all_to_all_single into a transposed output: max |out - sent| = "
             f"{_all_to_all_into_transposed(rank, world):g}"]
    every = [None] * world
    dist.all_gather_object(every, lines)  # one printer: the ranks' lines in order
    if rank == 0:
        for r, rank_lines in enumerate(every):
            for line in rank_lines:
                print(f"rank {r}: {line}", flush=True)
    dist.destroy_process_group()


def main(port: str = "29541") -> None:
    print(f"torch {torch.__version__}, gloo, 2 processes", flush=True)
    mp.spawn(_rank, args=(2, port), nprocs=2)


if __name__ == "__main__":
    main(os.environ.get("REPRO_PORT", "29541"))
