"""One gradient bucket's collectives on NCCL, alone on the machine: all-reduce against reduce-scatter and all-gather.

A standalone measurement (torch only):

    torchrun --nproc_per_node 4 docs/repro/bucket_collectives.py [--elements 40000000] [--reps 20]

A bucket of 40M fp32 elements is Megatron's default DDP bucket and the distributed optimiser's
(``harness.parallel.dist_opt``). The replicated optimiser all-reduces each bucket; the distributed one reduce-scatters
it (in place: a rank's piece of the bucket receives the sum) and all-gathers the updated piece back. Rank 0 prints each
collective's mean time over ``--reps`` calls after 3 untimed ones, with its algorithm bandwidth (bucket bytes / time):
what the step's breakdown can compare with the same kernels' durations inside a training step.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=40_000_000)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    r, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(r)
    N = a.elements // n * n
    c = N // n
    x = torch.randn(N, device="cuda")
    piece, full = torch.empty(c, device="cuda"), torch.empty(N, device="cuda")
    xb = x.bfloat16()
    group = dist.new_group(list(range(n)))
    cases = {
        "all_reduce": lambda: dist.all_reduce(x, group=group),
        "reduce_scatter in place": lambda: dist.reduce_scatter_tensor(x[r * c:(r + 1) * c], x, group=group),
        "reduce_scatter out of place": lambda: dist.reduce_scatter_tensor(piece, x, group=group),
        "all_gather in place": lambda: dist.all_gather_into_tensor(x, x[r * c:(r + 1) * c], group=group),
        "all_gather out of place": lambda: dist.all_gather_into_tensor(full, piece, group=group),
        "all_gather bf16 in place": lambda: dist.all_gather_into_tensor(xb, xb[r * c:(r + 1) * c], group=group),
    }
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / a.reps
        if r == 0:
            nbytes = N * (2 if "bf16" in name else 4)
            print(f"{name:28s} {ms:7.3f} ms  algbw {nbytes / ms / 1e6:7.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
