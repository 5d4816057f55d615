"""``bench step``'s workload and model figures: the global batches every arm trains on, the
model's FLOPs (for TFLOP/s and MFU) and the devices' peaks.

Shared by the job (which draws the batches) and the summary (which counts their FLOPs), so both
see the same numbers from the config alone.
"""

from __future__ import annotations

from harness.bench.step.config import BenchConfigError, StepBenchConfig
from harness.data.workloads import sample
from harness.plan import CostModel
from harness.runtime.model_config import MODELS

DEVICE_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0, "B200": 2250.0}
"""Dense bf16 peak TFLOP/s by device-name substring (vendor data sheets), for MFU."""


def global_batch_lengths(cfg: StepBenchConfig, world: int, index: int) -> tuple[list[int], int]:
    """(lengths of global batch ``index``, how many were clipped to the domain); its size follows
    ``cfg.global_batch``."""
    cap, budget = world * cfg.max_seqlen_per_rank, cfg.microbatches * world * cfg.max_seqlen_per_rank
    count = cfg.batch_sequences(world)
    out, total, clipped, chunk = [], 0, 0, 0
    while True:
        for L in sample(cfg.lengths, 256, seed=(cfg.seed + index) * 7919 + chunk):
            if L > cap:
                L, clipped = cap, clipped + 1
            if count is None and total + L > budget:
                return (out or [L]), clipped
            out.append(L)
            total += L
            if count is not None and len(out) == count:
                return out, clipped
        chunk += 1
        if chunk > 10_000:
            raise BenchConfigError(f"lengths {cfg.lengths!r} never fill a global batch of {budget} tokens")


def model_cost(cfg: StepBenchConfig, *, comm: bool = True) -> CostModel:
    """Training FLOPs per sequence of the benchmark model (``comm``: with the K/V exchange term)."""
    return MODELS[cfg.model].training_cost(cp_comm_flops_per_byte=cfg.cp_comm_flops_per_byte if comm else 0.0,
                                           per_microbatch_flops=cfg.per_microbatch_flops if comm else 0.0,
                                           name=cfg.model)


def model_flops(lengths: list[int], cost: CostModel) -> float:
    """Model FLOPs (forward + backward) of the real tokens: no padding, causal attention, no CP."""
    return float(sum(cost.seq_cost(L, 1) for L in lengths))


def peak_tflops(cfg: StepBenchConfig, device_name: str) -> float | None:
    """Peak dense TFLOP/s per GPU for MFU: the config's, else by device name (None when unknown)."""
    if cfg.peak_tflops:
        return cfg.peak_tflops
    return next((v for k, v in DEVICE_PEAK_TFLOPS.items() if k in device_name), None)
