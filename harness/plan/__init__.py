"""Pure planning layer (Python + numpy, never torch): dynamic-CP schedules and their checks.

Public API (stable):
    schedule(lengths, *, n_ranks, max_seqlen_per_rank, min_cp_size=1, vpp_group=None,
             algorithm="balanced", cost=None, execution=None, microbatch_tokens_per_rank=None,
             padding=None) -> Schedule   (Schedule.execution / .padding record them)
    validate_schedule(schedule_or_microbatches, lengths=None, **domain)   raises ScheduleError
    check_schedule(...) -> list[Violation]
    cp_min(L, max_seqlen_per_rank, min_cp_size=1)
    CostModel (megatron(), affine_quadratic(), from_model_shape())
    lower_bound(..., execution=None), simulate(schedule, cost=None, execution=None),
    simulate_step_time(schedule), quality(schedule, cost=None, execution=None), stats(...)
        (execution: an Execution or its name; None = the schedule's own, independent for lower_bound)
    Execution (INDEPENDENT, SYNCHRONOUS, Execution.pipeline(pp, vpp=1, schedule="1f1b")), resolve_execution
    SequencePadding(tp=1, domain=None): the runtime's padding of each sequence, priced by balanced and dp-balanced
"""

from harness.plan.api import ALGORITHMS, schedule
from harness.plan.bounds import (
    ScheduleStats,
    Simulation,
    lower_bound,
    quality,
    schedule_lower_bound,
    simulate,
    simulate_step_time,
    stats,
)
from harness.plan.cost import CostModel, cp_min, gpt_benchmark_cost, is_power_of_two
from harness.plan.errors import (
    BatchTooSmallError,
    DuplicateGidError,
    InvalidLengthError,
    NotPowerOfTwoError,
    PlanInputError,
    ScheduleError,
    SequenceTooLongError,
    SizeLimitError,
    UnknownAlgorithmError,
    VPPAlignmentError,
)
from harness.plan.execution import (
    INDEPENDENT,
    SYNCHRONOUS,
    Execution,
    ExecutionError,
    PassTime,
    UnknownExecutionError,
    resolve_execution,
    shares_from_layers,
    with_microbatch_order,
)
from harness.plan.layout import Block, Schedule
from harness.plan.lengths import normalize_lengths
from harness.plan.padding import SequencePadding
from harness.plan.validate import INVARIANTS, Violation, check_schedule, validate_schedule

__all__ = [
    "ALGORITHMS", "BatchTooSmallError", "Block", "CostModel", "DuplicateGidError", "Execution", "ExecutionError",
    "INDEPENDENT", "INVARIANTS", "InvalidLengthError", "NotPowerOfTwoError", "PassTime", "PlanInputError",
    "SYNCHRONOUS", "Schedule", "ScheduleError", "ScheduleStats", "SequencePadding", "SequenceTooLongError",
    "SizeLimitError", "UnknownAlgorithmError",
    "VPPAlignmentError", "Violation", "check_schedule", "cp_min", "gpt_benchmark_cost", "is_power_of_two",
    "lower_bound", "normalize_lengths", "quality", "schedule", "schedule_lower_bound", "shares_from_layers",
    "Simulation", "simulate", "simulate_step_time", "stats", "validate_schedule", "with_microbatch_order",
    "UnknownExecutionError", "resolve_execution",
]
