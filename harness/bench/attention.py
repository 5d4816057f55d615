"""``dcp-harness bench attention`` (GPU): CP attention forward + backward throughput.

For 32K and 128K tokens per pack (one sequence, and eight equal sequences; ``--tokens`` / ``--sequences`` pick others) and CP sizes 1, 2, 4 on
``min(4, GPUs)`` GPUs, every CP block of the world runs ``cp_attention`` (``backend``, default ``auto``,
i.e. ``flash`` on CUDA; bf16, 16 heads x 128) on its own copy of the pack. Figures: the median over iterations of the slowest
rank's time, TFLOP/s counting causal FLOPs (forward 2 L^2 H D per sequence, backward 2.5 x forward),
and the per-GPU efficiency relative to one GPU's attention (same backend) on the whole pack:
``t_1gpu / (cp * t_cp)``. Target: >= 0.8 at cp 4 with 128K tokens. For cp > 1 a breakdown times the
K/V exchange alone (all-gather, key gather and their backward) and the chunk attention alone, and
the same pack with the ``ring`` exchange (``harness.parallel.ring``: K/V passed around the block while
attention runs; its own efficiency column; the backend must have a log-sum-exp, else ``auto``) and with
the ``a2a`` exchange (``harness.parallel.ulysses``: heads traded for tokens; its own columns).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from harness.bench.common import REPORTS, table, write_report
from harness.finite import within
from harness.heartbeat import Heartbeat
from harness.jobs.entry import launch, register
from harness.parallel.groups import DynamicGroups, ParallelLayout
from harness.plan.thd import pack, padding_divisor, zigzag_index_array

JOB = register("bench-attention", "harness.bench.attention:measure")

DEFAULT = {"tokens": [32768, 131072], "shapes": [1, 8], "cps": [1, 2, 4], "heads": 16, "kv_heads": 16,
           "head_dim": 128, "warmup": 3, "iters": 10, "dtype": "bfloat16", "backend": "auto"}
TARGET = {"tokens": 131072, "sequences": 1, "cp": 4, "efficiency": 0.8}


def causal_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention over the sequences (backward = 2.5 x forward)."""
    return 3.5 * sum(2.0 * L * L * heads * head_dim for L in lengths)


def measure(rank: int, world: int, cfg: dict) -> list[dict]:
    """Runs on every rank under torchrun (``harness.jobs.entry bench-attention``)."""
    import torch
    import torch.distributed as dist

    # lazy: imports torch; the CLI imports this module without it
    from harness.parallel.collectives import gather_keys_values
    from harness.parallel.cp_attention import CPAttentionPlan, cp_attention  # lazy: torch, as above
    from harness.runtime.attention import LSE_BACKENDS, chunk_attention  # lazy: torch, as above

    cfg = {**DEFAULT, **cfg}
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, cfg["dtype"])
    H, Hkv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    backend = cfg["backend"]
    ring_backend = backend if backend in LSE_BACKENDS else "auto"
    groups = DynamicGroups(ParallelLayout(dp=world, cp=1), rank)
    heartbeat = Heartbeat.from_cfg(cfg, rank)
    rows = []

    def timed(fn):
        for _ in range(cfg["warmup"]):
            fn()
        times = []
        for _ in range(cfg["iters"]):
            dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    for T in cfg["tokens"]:
        for nseq in cfg["shapes"]:
            lengths = [T // nseq] * nseq
            g = torch.Generator(device=device).manual_seed(T + nseq)
            for cp in [c for c in cfg["cps"] if c <= world]:
                heartbeat.beat(tokens=T, sequences=nseq, cp=cp)
                p = pack(lengths, padding_divisor(cp_size=cp))
                full = [torch.randn(p.total_tokens, h, D, generator=g, device=device, dtype=dtype) for h in (H, Hkv, Hkv)]
                start = rank // cp * cp
                if cp == 1:  # the baseline: one GPU's attention on the whole pack
                    plan = CPAttentionPlan.build(p.cu_seqlens_padded, 1, 0, device)
                    q, k, v = (t.clone().requires_grad_() for t in full)

                    def step():
                        out = cp_attention(q, k, v, plan, None, backend=backend)
                        out.backward(torch.ones_like(out))
                else:
                    idx = torch.as_tensor(zigzag_index_array(p.cu_seqlens_padded, cp, rank - start), device=device)
                    q, k, v = (t[idx].clone().requires_grad_() for t in full)
                    plan = CPAttentionPlan.build(p.cu_seqlens_padded, cp, rank - start, device)
                    group = groups.for_block(start, cp)

                    def step():
                        out = cp_attention(q, k, v, plan, group, backend=backend)
                        out.backward(torch.ones_like(out))

                    k_local, v_local = (t.detach().requires_grad_() for t in (k, v))
                    k_keys, v_keys = (t.detach().requires_grad_() for t in gather_keys_values(
                        k_local.detach(), v_local.detach(), group, plan.chunks.key_index, plan.key_sources))

                    def comm():  # K/V all-gather + key gather, and their backward (fp32 sum, reduce-scatter)
                        gk, gv = gather_keys_values(k_local, v_local, group, plan.chunks.key_index, plan.key_sources)
                        torch.autograd.backward((gk, gv), (torch.ones_like(gk), torch.ones_like(gv)))

                    def compute():  # chunk attention on already-gathered keys only
                        out = chunk_attention(q, k_keys, v_keys, plan.chunks, backend=backend,
                                              keys_gathered=True)
                        out.backward(torch.ones_like(out))

                    ring_plan = CPAttentionPlan.build(p.cu_seqlens_padded, cp, rank - start, device, exchange="ring")

                    def ring():  # the same pack, K/V exchanged around the block's ring while attention runs
                        out = cp_attention(q, k, v, ring_plan, group, backend=ring_backend)
                        out.backward(torch.ones_like(out))

                    a2a_plan = CPAttentionPlan.build(p.cu_seqlens_padded, cp, rank - start, device, exchange="a2a")

                    def a2a():  # the same pack, heads exchanged for tokens (whole sequences, heads / cp a rank)
                        out = cp_attention(q, k, v, a2a_plan, group, backend=backend)
                        out.backward(torch.ones_like(out))
                seconds = timed(step)
                parts = {} if cp == 1 else {"comm_seconds": timed(comm), "attention_seconds": timed(compute),
                                            "ring_seconds": timed(ring), "a2a_seconds": timed(a2a)}
                rows.append({"tokens": T, "sequences": nseq, "cp": cp, "seconds": seconds,
                             "flops": causal_flops(lengths, H, D), **parts})
                del full  # q, k, v are rebound by the next configuration
                torch.cuda.empty_cache()
    return rows


def summarize(ranks: list[list[dict]]) -> list[dict]:
    """Slowest rank per configuration; TFLOP/s and efficiency against the cp = 1 baseline."""
    out = []
    for i, row in enumerate(ranks[0]):
        slowest = {k: max(r[i][k] for r in ranks) for k in row if k.endswith("seconds")}
        out.append({**row, **slowest})
    base = {(r["tokens"], r["sequences"]): r["seconds"] for r in out if r["cp"] == 1}
    for r in out:
        r["ms"] = r["seconds"] * 1e3
        r["tflops"] = r["flops"] / r["seconds"] / 1e12
        r["tflops_per_gpu"] = r["tflops"] / r["cp"]
        r["efficiency"] = base[(r["tokens"], r["sequences"])] / (r["cp"] * r["seconds"])
        r["comm_ms"] = r["comm_seconds"] * 1e3 if "comm_seconds" in r else None
        r["attention_ms"] = r["attention_seconds"] * 1e3 if "attention_seconds" in r else None
        for x in ("ring", "a2a"):
            r[f"{x}_ms"] = r[f"{x}_seconds"] * 1e3 if f"{x}_seconds" in r else None
            r[f"{x}_efficiency"] = (base[(r["tokens"], r["sequences"])] / (r["cp"] * r[f"{x}_seconds"])
                                    if f"{x}_seconds" in r else None)
    return out


COLUMNS = [("tokens", "tokens", "d"), ("sequences", "seqs", "d"), ("cp", "cp", "d"), ("ms", "fwd+bwd ms", ".2f"),
           ("tflops", "TFLOP/s", ".1f"), ("tflops_per_gpu", "TFLOP/s/GPU", ".1f"), ("efficiency", "efficiency", ".3f"),
           ("comm_ms", "K/V comm ms", ".2f"), ("attention_ms", "attention-only ms", ".2f"),
           ("ring_ms", "ring fwd+bwd ms", ".2f"), ("ring_efficiency", "ring efficiency", ".3f"),
           ("a2a_ms", "a2a fwd+bwd ms", ".2f"), ("a2a_efficiency", "a2a efficiency", ".3f")]


def main(*, out: Path | None = None, nproc: int | None = None, cfg: dict | None = None,
         stall_s: float | None = None) -> int:
    import tempfile

    import torch

    # lazy: imports torch; the CLI imports this module without it
    from harness.runtime.attention import BACKENDS

    backend = (cfg or {}).get("backend", DEFAULT["backend"])
    if backend != "auto" and backend not in BACKENDS:
        print(f"dcp-harness bench attention: unknown backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("dcp-harness bench attention: needs CUDA GPUs (run it on a GPU node)", file=sys.stderr)
        return 2
    n = nproc or min(4, torch.cuda.device_count())
    print(f"bench attention: {n} GPUs ({torch.cuda.get_device_name(0)}), torch {torch.__version__}, backend {backend}")
    with tempfile.TemporaryDirectory() as tmp:
        logs = (Path(out).parent if out else REPORTS) / "logs"
        res = launch(JOB, n, Path(tmp) / "bench.json", cfg, stall_s=stall_s,
                     log=logs / f"bench-attention-{time.strftime('%Y%m%d-%H%M%S')}.log")
    rows = summarize(res["ranks"])
    print(table(rows, COLUMNS))
    hit = [r for r in rows if (r["tokens"], r["sequences"], r["cp"]) ==
           (TARGET["tokens"], TARGET["sequences"], TARGET["cp"])]
    checks = [{"target": f"efficiency >= {TARGET['efficiency']} at cp {TARGET['cp']}, {TARGET['tokens']} tokens "
                         f"({TARGET['sequences']} sequence)", "value": hit[0]["efficiency"],
               "pass": within(hit[0]["efficiency"], TARGET["efficiency"], ">=")}] if hit else []
    for c in checks:
        print(f"  [{'PASS' if c['pass'] else 'FAIL'}] {c['target']}: {c['value']:.3f}")
    path = write_report("attention", {**DEFAULT, **(cfg or {}), "gpus": n,
                                            "device": torch.cuda.get_device_name(0)}, rows,
                        out=out, checks=checks)
    print(f"wrote {path}")
    return 0 if all(c["pass"] for c in checks) else 1
