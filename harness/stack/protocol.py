"""What a training stack provides for the harness's checks: a small protocol.

The harness judges a stack - its own runtime, megatron-core, a user's trainer - by what the stack reports
about one step, never by how the stack computes it. On every rank of the stack's DP x CP domain (positions
0..N-1; the harness's schedules address ranks by these positions), inside an initialised
``torch.distributed`` world:

- ``make(ctx)`` (a factory the user names, ``path/to/file.py:make`` or ``package.module:make``) returns a
  ``Stack`` for ``ctx`` (``StackContext``: rank, world, device, dtype, vocabulary);
- ``stack.build(seed)`` builds the model and its optimiser from ``seed``: every call with the same seed gives
  the same initial model on every rank and every run (the harness builds once per layout it checks, and once
  for the one-rank reference);
- ``stack.step(request)`` trains one step on the global batch ``request.batch`` laid out by
  ``request.schedule`` (``harness.plan.Schedule``: per micro-batch, the CP blocks and the sequences each
  holds) and returns a ``StepReport``: the step's loss (sum of token losses over the global batch's loss
  tokens), the gradient norm before clipping, the number of loss tokens it divided by, and - when
  ``request.want`` names them - every parameter's reduced gradient, the per-token losses of the tokens this
  rank computed, and the ranks of the CP group each of this rank's micro-batches ran in.

A stack that runs every sequence of a micro-batch as its own forward and backward (megatron-core's hybrid CP) says
so with ``sequence_passes = True`` (optional; default False): a micro-batch may then hold any number of sequences
per rank, and ``balanced`` packs the stack's micro-batches by the batch's tokens (``harness.train.layouts.
for_stack``). A stack whose steps end every micro-batch with a barrier over the DP x CP domain says so with
``execution = "synchronous"`` (optional; default ``"independent"``): ``balanced`` then schedules for that model.
With both, the schedule the stack's benchmark measures is the one ``verify`` checks.

A stack may offer ``sharpen(scale)`` (optional): multiply the query and key projections of every attention layer of
the model just built by ``scale`` (weights and biases of those rows; the attention logits grow by ``scale**2``).
At initialisation the logits are near zero, so a wrong position or a mis-sliced key barely moves step 1, and under
bf16's step-1 bands such a bug passes; ``verify`` therefore runs step 1 once more from a sharpened model in bf16
runs (``sharp_scale``), on every layout and on the reference alike, and holds its gradients and token losses to the
same bands, where the bug's footprint has grown ~16x (``docs/repro/sharp_attention_rope.py``).

``harness.stack.runtime.HarnessStack`` is the harness's own runtime behind this protocol;
``docs/examples/own_trainer.py`` is a plain-PyTorch trainer behind it; ``dcp-harness verify`` checks any of them
(``harness.stack.checks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from harness.plan import Schedule

WANTS = ("gradients", "token_losses", "cp_groups")
"""What a request may ask for beyond the loss, gradient norm and token count."""


class StackError(TypeError):
    """A stack broke the protocol (a missing method, a report of the wrong form); the message names the stack,
    the field and what it should be."""


@dataclass(frozen=True)
class StackContext:
    """Where a stack runs: this rank's place in the world, the device, the precision and the corpus's
    vocabulary (token ids are ``0..vocab-1``)."""

    rank: int
    world: int
    device: str
    dtype: str
    vocab: int


@dataclass(frozen=True)
class StepRequest:
    """One step to train: ``batch[g]`` is sequence ``g`` as ``L + 1`` token ids (inputs ``[:-1]``, next-token
    labels ``[1:]``, every label a loss token); ``schedule`` lays the batch out on the DP x CP positions;
    ``padding`` / ``fixed_length``: how the layout pads its micro-batches (``"local"``, ``"global"`` or
    ``"fixed"``; a stack may ignore them - padding changes no loss); ``want``: a subset of ``WANTS``."""

    step: int
    layout: str
    batch: list[np.ndarray]
    schedule: Schedule
    padding: str = "local"
    fixed_length: int = 0
    want: frozenset[str] = frozenset()

    def my_blocks(self, position: int) -> list:
        """``(micro-batch index, Block)`` of every micro-batch in which ``position`` holds sequences."""
        return [(m, b) for m, mb in enumerate(self.schedule.layout) for b in mb if b.gids and position in b.ranks]


@dataclass
class StepReport:
    """What a stack reports for one step on one rank."""

    loss: float
    """The step's loss: (sum of the global batch's token losses) / ``tokens`` - the same on every rank."""
    grad_norm: float
    """The L2 norm of the whole model's reduced gradient, before clipping - the same on every rank."""
    tokens: int
    """The loss tokens the loss was divided by (the global batch's labels: sum of ``len(seq) - 1``)."""
    gradients: dict[str, np.ndarray] | None = None
    """``want`` "gradients": every parameter this rank holds -> its reduced gradient before clipping."""
    token_losses: list[tuple[int, int, float]] | None = None
    """``want`` "token_losses": (sequence id, position in the sequence, cross-entropy) of every loss token this
    rank computed - a CP rank reports its slices only."""
    cp_groups: dict[int, tuple[int, ...]] | None = None
    """``want`` "cp_groups": micro-batch index -> the positions of the CP group this rank ran it in (read from
    the process group the stack used, e.g. ``dist.get_process_group_ranks``)."""
    extra: dict = field(default_factory=dict)


@runtime_checkable
class Stack(Protocol):
    """A training stack the harness can check (see the module doc)."""

    name: str

    def build(self, seed: int) -> None: ...

    def step(self, request: StepRequest) -> StepReport: ...


def checked_report(stack, report, request: StepRequest) -> StepReport:
    """``report`` if it is a well-formed ``StepReport`` for ``request``; else ``StackError`` naming the field."""
    who = getattr(stack, "name", type(stack).__name__)
    if not isinstance(report, StepReport):
        raise StackError(f"stack {who!r}: step() returned {type(report).__name__}, not a "
                         "harness.stack.StepReport; return StepReport(loss=..., grad_norm=..., tokens=...)")
    for name in ("loss", "grad_norm"):
        v = getattr(report, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise StackError(f"stack {who!r}: StepReport.{name} must be a Python float, got {type(v).__name__}; "
                             f"pass float(...) of the reduced value")
    if not isinstance(report.tokens, int) or isinstance(report.tokens, bool):
        raise StackError(f"stack {who!r}: StepReport.tokens must be an int, got {report.tokens!r}")
    for want in WANTS:
        if want in request.want and getattr(report, want) is None:
            raise StackError(f"stack {who!r}: step {request.step} asked for {want!r} but StepReport.{want} is None; "
                             f"fill it when {want!r} is in request.want")
    return report


def sequence_passes(stack) -> bool:
    """Whether ``stack`` runs each sequence of a micro-batch as its own pass (its optional ``sequence_passes``,
    default False); anything but a bool there is a ``StackError`` naming it."""
    v = getattr(stack, "sequence_passes", False)
    if not isinstance(v, bool):
        raise StackError(f"stack {getattr(stack, 'name', type(stack).__name__)!r}: sequence_passes must be a bool "
                         f"(True: each sequence of a micro-batch is its own forward and backward), got {v!r}")
    return v


def sharpens(stack) -> bool:
    """Whether ``stack`` offers ``sharpen(scale)`` (see the module doc); a ``sharpen`` that is not callable is a
    ``StackError`` naming it."""
    v = getattr(stack, "sharpen", None)
    if v is not None and not callable(v):
        raise StackError(f"stack {getattr(stack, 'name', type(stack).__name__)!r}: sharpen must be a method "
                         f"sharpen(scale) scaling the query and key projections, got {type(v).__name__}")
    return v is not None


EXECUTIONS = ("independent", "synchronous")
"""What a stack may declare as its ``execution`` (``harness.plan.execution``'s models without a pipeline)."""


def declared_execution(stack) -> str | None:
    """The execution model ``stack`` declares (its optional ``execution``), None when it declares none; anything
    but one of ``EXECUTIONS`` is a ``StackError`` naming it."""
    v = getattr(stack, "execution", None)
    if v is not None and v not in EXECUTIONS:
        raise StackError(f"stack {getattr(stack, 'name', type(stack).__name__)!r}: execution must be one of "
                         f"{', '.join(EXECUTIONS)} (how its steps synchronise the DP x CP domain), got {v!r}")
    return v


def checked_stack(stack, origin: str):
    """``stack`` if it has the protocol's methods; else ``StackError`` naming what is missing."""
    missing = [m for m in ("build", "step") if not callable(getattr(stack, m, None))]
    sequence_passes(stack)
    sharpens(stack)
    declared_execution(stack)
    if missing or not isinstance(getattr(stack, "name", None), str):
        what = ", ".join([f"{m}()" for m in missing] + ([] if isinstance(getattr(stack, "name", None), str)
                                                         else ["a str attribute 'name'"]))
        raise StackError(f"{origin} returned {type(stack).__name__}, which lacks {what}; a stack has name, "
                         "build(seed) and step(request) (harness.stack.Stack)")
    return stack
