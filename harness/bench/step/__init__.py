"""``dcp-harness bench step``: training step time of dynamic CP against static CP (torchrun).

Megatron's Dynamic-CP benchmark (``examples/dynamic_context_parallel``; ``peers.md`` 1.1) run with
this project's runtime: a GPT of 12 layers, hidden 2048, FFN 8192 (GeLU), 16 heads, vocabulary 32000
(``gpt-12l-h2048``); sequence lengths lognormal(mean 1024, sigma 1.5) clipped to [128, 8192];
``max_seqlen_per_rank`` 2048; bf16 autocast with fp32 weights, gradients and AdamW. On CUDA the
dense blocks' per-token segments and the loss head run through ``torch.compile`` (``compile``):
eager, the model is launch-bound.

Global batch ``i`` (the same for every arm): lengths drawn with seed ``seed + i`` until the next one
would pass ``microbatches x N x max_seqlen_per_rank`` tokens (8 full micro-batches of the DP x CP
domain; lengths longer than the domain holds are clipped to ``N x max_seqlen_per_rank`` and
counted). ``global_batch="megatron"`` instead takes exactly what Megatron's benchmark script loads:
``microbatches x dp`` sequences (8 at 4 GPUs with CP 4). Sequence ``g`` is loaded by position
``g % N`` (a DP shard) and rerouted by the schedule.

Arms (``layout:scheduler[:padding][@exchange]``):
- ``thd:dp-balanced``: static CP of ``static_cp`` ranks (default: the world), Megatron's
  ``dp_balanced`` packing - the baseline;
- ``dcp:<scheduler>``: dynamic CP with any ``harness.plan.ALGORITHMS`` scheduler (``balanced``,
  ``megatron-dev``, ...); padding ``local`` (``2 x local_cp_size``, default) or ``domain``;
- ``@gather`` / ``@ring`` / ``@auto`` after any arm: its CP blocks exchange K/V that way instead of
  ``cp_exchange`` (``harness.parallel.cp_attention.EXCHANGES``), so both exchanges run interleaved in one
  job (calibration uses ``cp_exchange``).

Before the arms (``calibrate``, default on), the job times the forward + backward of a few
micro-batch shapes per CP size (back to back, as micro-batches run in a step) and fits the
scheduler's cost model to them in seconds (quadratic, linear, K/V-exchange, per-micro-batch and
per-CP-block terms; ``calibrate_cost``): ``balanced`` then optimises this machine's measured
costs, and the step-time model's prediction is in milliseconds, next to the measurement.
``megatron-*`` schedulers ignore the cost model (as upstream).

One step = schedule + reroute + every micro-batch's forward/backward with CP attention in its
block's process group + gradient all-reduce over the DP x CP group (a flat fp32 buffer the
gradients accumulate into; by default in buckets overlapped with the last backward,
``grad_reduce``) + clipping + AdamW. Every measured step also times its phases (``PHASES``: CUDA
events, read after the step) - where dynamic CP saves time (the micro-batches) and where it cannot.
Each arm starts from the same weights and runs ``warmup`` then ``iters`` steps, each between a
barrier + device synchronisation and a device synchronisation; a step's time is the slowest rank's.
The arms are interleaved step by step in a rotating order (``_run_arms``), each with its own weights
and optimizer state, so that drift over the run does not favour the arm that runs first. Reported
per arm: the 10%-trimmed mean, median and mean step time, tokens/s/GPU (real tokens), MFU (model
FLOPs of the real tokens with causal attention, over the GPUs' peak), padding, micro-batches, the
step-time model's prediction, the step phases, and a measured breakdown (attention, linear, other
kernels, exposed communication, idle) from ``profile_iters`` extra profiled steps after the last
run (``harness.bench.trace``; only the last run profiles, since a profiler session leaves host
overhead behind in the process).

The whole measurement (calibration, every arm's warm-up and measured steps) repeats ``runs`` times
in one job; the targets are judged on the median over runs of each ratio
(``summarize``, ``checks``), and the report details the run with the median speedup.

Modules, in import order (each imports only those before it; none imports the package itself):
``config`` (options, arms, errors, cost-model inputs) -> ``workload`` (global batches, FLOPs) ->
``rank`` (one rank's step) -> ``calibrate`` (cost fit) -> ``job`` (``measure``, the torchrun job) ->
``summarise`` (statistics, targets) -> ``cli`` (``main``: run, print, write). The tables' columns
live in ``harness.report.step_tables``: the HTML report reads results and never imports a benchmark.
The names below are this package's public interface (``harness.jobs.entry`` runs
``harness.bench.step:measure``).
"""

from harness.bench.step.calibrate import (
    CALIBRATION_TERMS,
    calibrate_cost,
    calibration_features,
    calibration_shapes,
    fit_cost,
    rank_slowdown,
)
from harness.bench.step.cli import CPU_SMOKE, JOB, main
from harness.bench.step.config import (
    COMPILE_CHOICES,
    GLOBAL_BATCH_CHOICES,
    GRAD_REDUCE_CHOICES,
    MAX_BATCH_SEQUENCES,
    PHASES,
    Arm,
    BenchConfigError,
    StepBenchConfig,
    cost_model_from,
    load_cost_model,
    parse_arm,
)
from harness.bench.step.job import measure, weights_digest
from harness.bench.step.summarise import (
    BREAKDOWN_FIELDS,
    RATIOS,
    TARGETS,
    checks,
    paired_ratio,
    phase_times,
    summarize,
    trimmed_mean,
)
from harness.bench.step.workload import DEVICE_PEAK_TFLOPS, global_batch_lengths, model_cost, model_flops, peak_tflops
from harness.report.step_tables import (
    BREAKDOWN_COLUMNS,
    COLUMNS,
    PHASE_COLUMNS,
    phase_rows,
    run_columns,
    runs_rows,
)

__all__ = [
    "BREAKDOWN_COLUMNS", "BREAKDOWN_FIELDS", "CALIBRATION_TERMS", "COLUMNS", "COMPILE_CHOICES", "CPU_SMOKE",
    "DEVICE_PEAK_TFLOPS", "GLOBAL_BATCH_CHOICES", "GRAD_REDUCE_CHOICES", "MAX_BATCH_SEQUENCES", "PHASES",
    "JOB", "PHASE_COLUMNS", "RATIOS", "TARGETS", "Arm", "BenchConfigError", "StepBenchConfig", "calibrate_cost",
    "calibration_features", "calibration_shapes", "checks", "cost_model_from", "fit_cost", "global_batch_lengths",
    "load_cost_model", "main", "measure", "model_cost", "model_flops", "paired_ratio", "parse_arm", "peak_tflops",
    "phase_rows",
    "phase_times", "rank_slowdown", "run_columns", "runs_rows", "summarize", "trimmed_mean", "weights_digest",
]
