"""A pipeline's configuration (stages, virtual chunks, schedule, delivery) and its checks: no torch, so a launching
process validates a run before any rank starts (``harness.train.pipeline`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.plan.errors import PlanInputError
from harness.plan.pipeline import model_split
from harness.plan.pipeline_schedule import check_pipeline

DELIVERIES = ("broadcast", "compute")


class PipelineConfigError(PlanInputError):
    """A pipeline configuration that cannot run (names the value and the fix)."""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    pp: int = 1
    """Pipeline stages."""
    vpp: int = 1
    """Virtual chunks per stage (interleaved schedule when > 1)."""
    schedule: str = "1f1b"
    """``afab`` or ``1f1b`` (with vpp > 1 the interleaved 1F1B runs)."""
    group: int | None = None
    """``microbatch_group_size_per_vp_stage`` (default pp): the interleaved schedule needs the
    micro-batch count to be a multiple of it, so schedules are aligned to it."""
    delivery: str = "broadcast"
    """``broadcast``: the first stage computes each schedule and sends it down the pipelines;
    ``compute``: every stage computes it; either way the stages must agree."""

    @property
    def kind(self) -> str:
        return "interleaved" if self.vpp > 1 else self.schedule

    @property
    def vpp_group(self) -> int | None:
        return (self.group or self.pp) if self.vpp > 1 else None

    def validate(self, world: int, num_layers: int) -> None:
        if self.schedule not in ("afab", "1f1b"):
            raise PipelineConfigError(f"pipeline schedule must be afab or 1f1b (interleaved follows from vpp > 1), "
                                      f"got {self.schedule!r}")
        if self.delivery not in DELIVERIES:
            raise PipelineConfigError(f"schedule delivery must be one of {', '.join(DELIVERIES)}, got "
                                      f"{self.delivery!r}")
        if not isinstance(self.pp, int) or self.pp < 1 or world % self.pp:
            raise PipelineConfigError(f"pp={self.pp!r} must be a positive divisor of the world ({world} ranks); "
                                      f"use pp in {[d for d in range(1, world + 1) if world % d == 0]}")
        check_pipeline(self.kind, self.pp, self.vpp_group or 1, self.vpp, self.vpp_group)
        split(num_layers, self.pp, self.vpp)


def split(num_layers: int, pp: int, vpp: int = 1) -> list[list[tuple[int, int]]]:
    """``harness.plan.pipeline.model_split``: an even split, else one that counts the embedding and / or the
    loss as a layer (Megatron's ``account_for_*_in_pipeline_split``) so that the slots divide. A seam
    (``Stage.of`` looks it up when a rank builds its stage): ``harness.faults`` re-creates wrong layer offsets."""
    try:
        return model_split(num_layers, pp, vpp)
    except PlanInputError as e:
        raise PipelineConfigError(str(e)) from None
