"""``dcp-harness bench loss``: the LM head and its cross-entropy, whole against chunked (``harness.runtime.chunked_loss``).

One head (``T`` tokens of hidden size ``E``, a vocabulary of ``V``; the model's loss head: ``linear(h, w).float()``
then the cross-entropy, bf16 autocast on CUDA) forward and backward under per-token upstream gradients (a tenth of the
tokens weigh 0, as padding does), for the whole logits (chunk 0) and each chunk size. The arms alternate within every
round (``rounds`` rounds after one warm-up each); the report gives each arm's median time and its ratio to the whole
head's, measured side by side, and on CUDA each arm's peak memory above its inputs (``max_memory_allocated``, one
untimed call after the timed ones); on the CPU torch has no allocator statistics, so the report gives the logits'
bytes each arm holds at once instead (``T x V`` fp32 whole, ``chunk x V`` chunked). Every chunked arm's losses and
gradients are compared with the whole head's (relative to their largest magnitude).

Targets, on CUDA at the default shapes: each chunk of at most ``T / 8`` tokens needs at most a quarter of the whole
head's peak memory, in at most 1.5x its time (the chunked backward computes the head's forward GEMM again: 4 GEMMs
against 3).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.bench.common import table, write_report
from harness.finite import within
from harness.runtime.chunked_loss import head_losses

MEMORY_TARGET = 4.0
"""The whole head's peak memory over a chunked arm's, at least (chunks of at most ``T / 8`` tokens, CUDA)."""
TIME_TARGET = 1.5
"""A chunked arm's median time over the whole head's, at most (chunks of at most ``T / 8`` tokens, CUDA)."""
DEFAULTS = {"cuda": {"tokens": 32768, "hidden": 4096, "vocab": 128256, "chunks": (0, 2048, 4096, 8192)},
            "cpu": {"tokens": 2048, "hidden": 128, "vocab": 16000, "chunks": (0, 256, 512)}}
"""Shapes per device: on CUDA a 32K-token pack of an 8B model's head (Llama 3's vocabulary); on the CPU a smaller one
that runs in seconds."""


def _inputs(tokens: int, hidden: int, vocab: int, device: torch.device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(tokens, hidden, generator=g) / hidden ** 0.5 * 4).to(device)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    weight = ((torch.rand(tokens, generator=g) > 0.1).float() / tokens).to(device)
    return h, w, labels, weight


def _step(h, w, labels, weight, chunk: int, bf16: bool):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=bf16):
        if chunk:
            loss = head_losses(h, w, labels, chunk)
        else:
            loss = F.cross_entropy(F.linear(h, w).float(), labels, reduction="none")
    (loss * weight).sum().backward()
    return loss.detach(), h.grad, w.grad


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(fn, device: torch.device) -> int | None:
    """Peak allocated bytes of ``fn()`` above what was allocated before it (CUDA), None elsewhere."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return peak


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def run(device: str = "cpu", tokens: int | None = None, hidden: int | None = None, vocab: int | None = None,
        chunks: tuple[int, ...] | None = None, rounds: int = 5, seed: int = 0) -> dict:
    """Every arm's median seconds, ratio to the whole head, memory and deviations (see the module doc)."""
    d = DEFAULTS["cuda" if device == "cuda" else "cpu"]
    tokens, hidden, vocab = tokens or d["tokens"], hidden or d["hidden"], vocab or d["vocab"]
    chunks = tuple(chunks) if chunks else d["chunks"]
    if 0 not in chunks:
        chunks = (0, *chunks)  # the whole head: every ratio's denominator
    dev = torch.device(device)
    bf16 = dev.type == "cuda"
    h, w, labels, weight = _inputs(tokens, hidden, vocab, dev, seed)
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for c in chunks:  # warm-up: kernels chosen, allocator grown
        _step(h, w, labels, weight, c, bf16)
    for _ in range(rounds):
        for c in chunks:  # alternated within the round: the arms share the machine's moments
            _sync(dev)
            t = time.perf_counter()
            _step(h, w, labels, weight, c, bf16)
            _sync(dev)
            times[c].append(time.perf_counter() - t)
    whole = _step(h, w, labels, weight, 0, bf16)
    rows = []
    for c in chunks:
        got = whole if c == 0 else _step(h, w, labels, weight, c, bf16)
        peak = _peak_bytes(lambda c=c: _step(h, w, labels, weight, c, bf16), dev)
        rows.append({"chunk": c, "ms": statistics.median(times[c]) * 1e3, "times_ms": [t * 1e3 for t in times[c]],
                     "peak_mib": None if peak is None else peak / 2**20,
                     "logits_mib": (c or tokens) * vocab * 4 / 2**20,
                     "loss_dev": _rel(got[0], whole[0]), "dh_dev": _rel(got[1], whole[1]),
                     "dw_dev": _rel(got[2], whole[2])})
    base = rows[0]
    for r in rows:
        r["time_ratio"] = r["ms"] / base["ms"]
        r["memory_saved"] = (base["peak_mib"] / r["peak_mib"]) if r["peak_mib"] else None
    config = {"device": device, "device_name": torch.cuda.get_device_name(dev) if bf16 else "cpu",
              "tokens": tokens, "hidden": hidden, "vocab": vocab, "chunks": list(chunks), "rounds": rounds,
              "dtype": "bfloat16 (autocast)" if bf16 else "float32", "seed": seed}
    return {"config": config, "rows": rows}


def checks_of(result: dict) -> list[dict]:
    """The targets (CUDA only: the CPU has no peak memory to judge) and, everywhere, each chunked arm's agreement with
    the whole head (fp32: 1e-4; bf16: 5e-2 of the largest magnitude)."""
    cfg, out = result["config"], []
    tol = 5e-2 if cfg["device"] == "cuda" else 1e-4
    for r in result["rows"][1:]:
        worst = max(r["loss_dev"], r["dh_dev"], r["dw_dev"])
        out.append({"target": f"chunk {r['chunk']}: losses and gradients within {tol:g} of the whole head's",
                    "value": worst, "pass": within(worst, tol)})
        if cfg["device"] == "cuda" and r["chunk"] <= cfg["tokens"] // 8:
            out.append({"target": f"chunk {r['chunk']}: peak memory at most 1/{MEMORY_TARGET:g} of the whole head's",
                        "value": r["memory_saved"], "pass": r["memory_saved"] is not None
                        and r["memory_saved"] >= MEMORY_TARGET})
            out.append({"target": f"chunk {r['chunk']}: median time at most {TIME_TARGET:g}x the whole head's",
                        "value": r["time_ratio"], "pass": within(r["time_ratio"], TIME_TARGET)})
    return out


def main(out: Path | None = None, **kw) -> int:
    result = run(**kw)
    c = result["config"]
    print(f"LM head + cross-entropy, {c['tokens']} tokens x hidden {c['hidden']} x vocabulary {c['vocab']}, "
          f"{c['dtype']} on {c['device_name']}, {c['rounds']} alternated rounds (medians)")
    print(table(result["rows"], [("chunk", "chunk", "d"), ("ms", "ms", ".2f"), ("time_ratio", "x whole", ".3f"),
                                 ("peak_mib", "peak MiB", ".0f"), ("memory_saved", "mem saved", ".1f"),
                                 ("logits_mib", "logits MiB", ".0f"), ("dw_dev", "dW dev", ".1e"),
                                 ("dh_dev", "dh dev", ".1e")]))
    checks = checks_of(result)
    for ch in checks:
        print(f"  [{'PASS' if ch['pass'] else 'FAIL'}] {ch['target']}: {ch['value']:.3g}")
    print(f"wrote {write_report('loss', result['config'], result['rows'], out=out, checks=checks)}")
    return 0 if all(ch["pass"] for ch in checks) else 1
