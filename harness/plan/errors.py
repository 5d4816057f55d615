"""Typed errors of the planning layer.

Every user-facing error is a ``ValueError`` subclass whose message names the offending value and
says how to fix it. ``assert`` is reserved for internal invariants.
"""

from __future__ import annotations


class PlanInputError(ValueError):
    """Bad input to a planning function (lengths, sizes, algorithm name...)."""


class InvalidLengthError(PlanInputError):
    """A sequence length is not a positive integer."""


class DuplicateGidError(PlanInputError):
    """Two sequences carry the same global id."""


class NotPowerOfTwoError(PlanInputError):
    """A size that must be a power of two is not."""


class SequenceTooLongError(PlanInputError):
    """A sequence needs a CP group larger than the DP x CP domain."""


class UnknownAlgorithmError(PlanInputError):
    """The scheduler name is not registered."""


class BatchTooSmallError(PlanInputError):
    """The batch has too few sequences for the micro-batch count the layout requires (e.g. static
    CP needs at least one pack per DP replica)."""


class VPPAlignmentError(BatchTooSmallError):
    """The micro-batch count cannot be made a multiple of the VPP group size."""


class SizeLimitError(PlanInputError):
    """A size exceeds what the planning layer is built for (``harness.plan.limits``): the message names
    the value, the limit and why."""


class ScheduleError(ValueError):
    """A schedule violates one of the invariants of ``harness.plan.validate``.

    Attributes:
        invariant: the invariant's name (see ``harness.plan.validate.INVARIANTS``).
        microbatch: index of the offending micro-batch, or None for batch-wide invariants.
        ranks: the DP x CP positions involved (may be empty).
        detail: a sentence with the values.
    """

    def __init__(self, invariant: str, microbatch: int | None, ranks: list[int], detail: str):
        self.invariant = invariant
        self.microbatch = microbatch
        self.ranks = list(ranks)
        self.detail = detail
        where = "" if microbatch is None else f" in micro-batch {microbatch}"
        at = f" at ranks {_span(self.ranks)}" if self.ranks else ""
        super().__init__(f"schedule violates invariant '{invariant}'{where}{at}: {detail}")


def _span(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}..{ranks[-1]}"
    return str(ranks)


class LayoutError(PlanInputError):
    """A layout (bshd, thd, dcp; a pipeline or expert-parallel configuration) cannot run this world or batch
    (names the values and the fix)."""
