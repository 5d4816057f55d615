"""Pipeline schedules: the order in which one stage runs the forward and backward passes of its model
chunks over a global batch's micro-batches (Megatron-core's ``forward_backward_*`` orders; no torch).

Model chunk ``c = v * pp + s`` (virtual chunk v of stage s) holds the layers ``layer_ranges`` gives
it; the forward of micro-batch m runs chunks 0, 1, ..., pp * vpp - 1 in order, the backward in
reverse. Kinds:

* ``afab`` (all forward, all backward): every forward, then every backward. The reference.
* ``1f1b``: ``min(pp - s - 1, M)`` warm-up forwards, then one forward and one backward in turn, then
  the remaining backwards; at most ``pp - s`` micro-batches' activations alive on stage s.
* ``interleaved`` (1F1B with ``vpp`` > 1 chunks per stage): virtual micro-batch k is micro-batch
  ``(k // (g * vpp)) * g + k % g`` on chunk ``(k // g) % vpp`` (backwards: the chunks in reverse), with
  ``g = microbatch_group_size_per_vp_stage`` (default ``pp``); ``(pp - s - 1) * 2 + (vpp - 1) * g``
  warm-up forwards (all of them when M == g). Needs ``M % g == 0``.

>>> [str(a) for a in stage_actions("1f1b", pp=2, stage=0, num_microbatches=3)]
['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
>>> [str(a) for a in stage_actions("1f1b", pp=2, stage=1, num_microbatches=3)]
['F0', 'B0', 'F1', 'B1', 'F2', 'B2']
>>> [str(a) for a in stage_actions("interleaved", pp=2, stage=1, num_microbatches=2, vpp=2)]
['F0.0', 'F1.0', 'F0.1', 'F1.1', 'B0.1', 'B1.1', 'B0.0', 'B1.0']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.plan.errors import PlanInputError

KINDS = ("afab", "1f1b", "interleaved")


class PipelineScheduleError(PlanInputError):
    """A pipeline schedule that cannot be built (names the value and the fix)."""


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch through one model chunk of a stage."""

    kind: str  # "F" (forward) or "B" (backward)
    microbatch: int
    chunk: int = 0  # virtual chunk v of the stage (0 without VPP)
    virtual: bool = field(default=False, compare=False)  # shown as F<m>.<chunk> (interleaved schedules)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.virtual else "")


def check_pipeline(kind: str, pp: int, num_microbatches: int, vpp: int = 1, group: int | None = None) -> int:
    """Validate a pipeline configuration; returns the micro-batch group size of the interleaved kind."""
    if kind not in KINDS:
        raise PipelineScheduleError(f"unknown pipeline schedule {kind!r}; choose from {', '.join(KINDS)}")
    for name, v in (("pipeline_model_parallel_size", pp), ("virtual_pipeline_model_parallel_size", vpp)):
        if not isinstance(v, int) or v < 1:
            raise PipelineScheduleError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise PipelineScheduleError(f"the number of micro-batches must be >= 1, got {num_microbatches!r}")
    if vpp > 1 and pp == 1:
        raise PipelineScheduleError(f"virtual_pipeline_model_parallel_size={vpp} needs pipeline parallelism: "
                                    f"use pp >= 2, or vpp 1")
    if (kind == "interleaved") != (vpp > 1):
        raise PipelineScheduleError(f"schedule {kind!r} with virtual_pipeline_model_parallel_size={vpp}: use "
                                    f"'interleaved' exactly when vpp > 1")
    g = group or pp
    if kind == "interleaved" and num_microbatches % g:
        raise PipelineScheduleError(
            f"the interleaved schedule needs the micro-batch count to be a multiple of "
            f"microbatch_group_size_per_vp_stage={g}, got {num_microbatches}; align the schedule "
            f"(schedule(..., vpp_group={g})) or change the global batch")
    return g


def stage_actions(kind: str, *, pp: int, stage: int, num_microbatches: int, vpp: int = 1,
                  group: int | None = None) -> list[Action]:
    """Stage ``stage``'s passes, in the order it runs them (see module doc)."""
    g = check_pipeline(kind, pp, num_microbatches, vpp, group)
    if not 0 <= stage < pp:
        raise PipelineScheduleError(f"stage {stage} outside a pipeline of {pp} stages")
    M = num_microbatches
    if kind == "afab":
        return [Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)]
    if kind == "1f1b":
        warm = min(pp - stage - 1, M)
        fwd = [Action("F", m) for m in range(M)]
        bwd = [Action("B", m) for m in range(M)]
        return _one_f_one_b(fwd, bwd, warm)
    total = M * vpp
    fwd = [Action("F", _mb(k, g, vpp), (k // g) % vpp, True) for k in range(total)]
    bwd = [Action("B", _mb(k, g, vpp), vpp - 1 - (k // g) % vpp, True) for k in range(total)]
    warm = total if M == g else min((pp - stage - 1) * 2 + (vpp - 1) * g, total)
    return _one_f_one_b(fwd, bwd, warm)


def _mb(k: int, g: int, vpp: int) -> int:
    return (k // (g * vpp)) * g + k % g


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warm: int) -> list[Action]:
    out = fwd[:warm]
    for i in range(len(fwd) - warm):
        out += [fwd[warm + i], bwd[i]]
    return out + bwd[len(fwd) - warm:]


def chunk_index(stage: int, chunk: int, pp: int) -> int:
    """Position of a stage's virtual chunk in the model: ``chunk * pp + stage``."""
    return chunk * pp + stage


def chunk_location(c: int, pp: int) -> tuple[int, int]:
    """(stage, virtual chunk) of model chunk ``c``."""
    return c % pp, c // pp


def replay(plans: list[list[Action]], pp: int, vpp: int = 1) -> list[tuple[int, Action]]:
    """The order in which the stages' passes can complete when every send is asynchronous and every
    receive waits: a forward needs the previous chunk's forward of its micro-batch, a backward the
    next chunk's backward (the last chunk: its own forward). Raises ``PipelineScheduleError`` when the
    plans deadlock. Used by the suites and the simulator to check schedules."""
    done, pos, order = set(), [0] * pp, []
    last = pp * vpp - 1
    while any(pos[s] < len(plans[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while pos[s] < len(plans[s]):
                a = plans[s][pos[s]]
                c = chunk_index(s, a.chunk, pp)
                need = ("F", a.microbatch, c - 1) if a.kind == "F" else \
                    ("F", a.microbatch, c) if c == last else ("B", a.microbatch, c + 1)
                if a.kind == "F" and c == 0:
                    need = None
                if need is not None and need not in done:
                    break
                done.add((a.kind, a.microbatch, c))
                order.append((s, a))
                pos[s] += 1
                moved = True
        if not moved:
            stuck = {s: str(plans[s][pos[s]]) for s in range(pp) if pos[s] < len(plans[s])}
            raise PipelineScheduleError(f"the stages' passes deadlock: each waits for another ({stuck})")
    return order
