"""cuBLASLt's heuristics cache against the GEMM shapes of variable-length training: a standalone reproduction.

    python docs/repro/cublaslt_shape_cache.py [--counts 1024] [--passes 3] [--bucket 0]
    CUBLASLT_HEURISTICS_CACHE_CAPACITY=65536 python docs/repro/cublaslt_shape_cache.py

(torch and one CUDA GPU). In THD-packed training every matrix multiply of a micro-batch has the rank's token count
as one dimension, and that count changes from micro-batch to micro-batch: any integer up to the pack's capacity.
torch.mm on bf16 goes through cuBLASLt, which chooses a kernel per shape and keeps its choices in a heuristics
cache (``CUBLASLT_HEURISTICS_CACHE_CAPACITY``, default 8192 shapes). A transformer layer makes ~10 GEMM shapes per
token count (forward, data gradient and weight gradient of each weight), so ~1,000 token counts are ~10,000 shapes:
more than the cache holds, and a run keeps missing however long it trains.

The script plays that pattern: ``--counts`` token counts (2, 4, ..., shuffled) times the ten GEMMs of a GPT layer of
hidden size 2048 (QKV 2048 x 6144, output 2048 x 2048, FFN 2048 x 8192 and 8192 x 2048; forward, dgrad and wgrad of
the first three, the forward of the last), ``--passes`` times over the same counts, and prints the mean microseconds a
call (host launch and device time, synchronising every 200 calls). With the default cache every pass costs about
the same as the first; with the capacity raised the second pass runs at the device's pace; ``--bucket 64`` rounds
each count up to a multiple of 64 (at most 32 shapes per GEMM): what ``bench step --token-bucket`` does.

On one H200 (torch 2.11, CUDA 13; ``reports/recorded/token_bucket.h200x2.log``): default cache 251 / 208 / 221 us a
call over three passes; capacity 65536: 219 / 36 / 36 us; capacity 0: 222 / 123 / 135 us.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def gemms(m: int, x: torch.Tensor, weights: list[torch.Tensor], down: torch.Tensor) -> list:
    """The ten GEMMs of one layer at ``m`` tokens (closures over preallocated inputs)."""
    a, h = x[:m, :2048], x[:m]
    calls = []
    for w in weights:
        g = torch.empty(m, w.shape[1], device=x.device, dtype=x.dtype)
        calls += [lambda a=a, w=w: torch.mm(a, w), lambda g=g, w=w: torch.mm(g, w.t()), lambda a=a, g=g: torch.mm(a.t(), g)]
    return calls + [lambda h=h: torch.mm(h, down)]


def sweep(calls: list) -> float:
    """Mean microseconds a call over ``calls``, synchronising every 200."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i, f in enumerate(calls):
        f()
        if i % 200 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / len(calls) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, default=1024, help="distinct token counts (2, 4, ...; at most 4096)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--bucket", type=int, default=0, help="round each count up to a multiple of this (0: off)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cublaslt_shape_cache.py: needs a CUDA GPU")
    if not 1 <= a.counts <= 4096 or a.passes < 1 or a.bucket < 0:
        raise SystemExit("cublaslt_shape_cache.py: --counts 1..4096, --passes >= 1, --bucket >= 0")
    dev, dt = "cuda", torch.bfloat16
    weights = [torch.randn(2048, n, device=dev, dtype=dt) for n in (6144, 2048, 8192)]
    down = torch.randn(8192, 2048, device=dev, dtype=dt)
    x = torch.randn(8192, 8192, device=dev, dtype=dt)
    counts = list(range(2, 2 * a.counts + 1, 2))
    random.Random(1).shuffle(counts)
    if a.bucket:
        counts = [-(-m // a.bucket) * a.bucket for m in counts]
    calls = [f for m in counts for f in gemms(m, x, weights, down)]
    print(f"{len(set(counts))} token counts x 10 GEMMs = {len(calls)} calls a pass")
    for p in range(a.passes):
        print(f"pass {p + 1}: {sweep(calls):.1f} us a call")


if __name__ == "__main__":
    main()
