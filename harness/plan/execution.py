"""How a schedule runs: the execution model that ``simulate`` / ``lower_bound`` / ``quality`` judge it by.

A dynamic-CP schedule fixes which ranks run which sequences in each micro-batch; how long the step takes
also depends on what else synchronises the ranks. ``Execution`` names that, so one schedule can be judged
under each model without its callers changing (a new kind is a new entry of ``SIMULATORS`` and
``BOUNDS``):

* ``independent`` (``INDEPENDENT``, the default): every rank runs its micro-batches in order; a CP block
  starts when all of its ranks are free (training without pipeline parallelism, until the gradient
  all-reduce that ends the step).
* ``synchronous`` (``SYNCHRONOUS``): a barrier over the DP x CP domain after every micro-batch (MoE with
  expert parallelism: every rank joins the all-to-alls of every micro-batch), so each micro-batch takes
  the time of its slowest rank and the micro-batches run back to back.
* ``pipeline`` (``Execution.pipeline(pp, vpp=, schedule=)``): ``pp`` stages, each the same DP x CP domain
  running the same micro-batches with the same blocks, in the pass order of
  ``harness.plan.pipeline_schedule.stage_actions`` (``afab``, ``1f1b``, ``interleaved`` when vpp > 1).

Pipeline rules. Model chunk ``c = v * pp + s`` (virtual chunk v of stage s) holds ``share(c)`` of the model
(``1 / (pp * vpp)`` each by default, or ``chunk_shares``). The pass (F or B of micro-batch m on chunk c) at
(stage s, position p) lasts ``block_cost(block of p in m) * share(c) * phase`` with phase ``forward_share``
(1/3) for F and ``1 - forward_share`` for B, and starts at the latest of: (a) the rank finished its previous
pass in the stage's order; (b) its input is there: the forward of m on chunk c - 1 at position p (nothing
for c = 0), the backward of m on chunk c + 1 (for the last chunk: its own forward); (c) every rank of its
CP block in stage s satisfies (a) and (b) (a block's ranks run each pass together: CP collectives). Sends
take no time. Step time = the last pass's end; ``busy`` / ``waiting`` are per rank, stage-major
(``stage * n_ranks + position``, Megatron's rank order with PP slowest); ``Simulation.bubble_fraction`` =
``1 - sum(busy) / (ranks * step_time)``.

Worked example: one position (n_ranks 1), two micro-batches of 6 and 12 tokens, cost = L (linear), pp 2:
a pass costs L * 1/2 * 1/3 forward and L * 1/2 * 2/3 backward, so F0 = 1, B0 = 2, F1 = 2, B1 = 4. 1F1B:
stage 0 runs F0 F1 B0 B1 and stage 1 runs F0 B0 F1 B1:

    stage 0: F0 [0, 1]  F1 [1, 3]  B0 [4, 6] (waits for stage 1's B0)  B1 [10, 14]
    stage 1: F0 [1, 2]  B0 [2, 4]  F1 [4, 6]  B1 [6, 10]

step 14; busy 9 per rank, so the bubble is 1 - 18 / (2 * 14) = 5/14; waiting 5 on stage 0 (3 -> 4, 6 -> 10)
and 1 on stage 1 (0 -> 1; its idle tail 10 -> 14 counts in the bubble, not as waiting). AFAB runs F0 F1 B0 B1 on both stages:
stage 1 runs F0 [1, 2] F1 [3, 5] B0 [5, 7] B1 [7, 11] and stage 0 B0 [7, 9] B1 [11, 15]: step 15, bubble
1 - 18 / 30 = 0.4.

>>> from harness.plan.cost import CostModel
>>> from harness.plan.layout import Block, Schedule
>>> s = Schedule.from_blocks([[Block(0, 1, (0,))], [Block(0, 1, (1,))]], lengths=[6, 12], n_ranks=1,
...                          max_seqlen_per_rank=12, cost=CostModel(quadratic=0.0, linear=1.0))
>>> sim = simulate_execution(s, s.cost, Execution.pipeline(2, schedule="1f1b"))
>>> sim.step_time, sim.busy, sim.waiting, round(sim.bubble_fraction, 4)
(14.0, [9.0, 9.0], [5.0, 1.0], 0.3571)
>>> [(str(p), p.start, p.end) for p in sim.passes if p.stage == 0]
[('F0', 0.0, 1.0), ('F1', 1.0, 3.0), ('B0', 4.0, 6.0), ('B1', 10.0, 14.0)]
>>> simulate_execution(s, s.cost, Execution.pipeline(2, schedule="afab")).step_time
15.0

Order matters. Three micro-batches of 12, 6 and 6 tokens (F = 2, 1, 1; B = 4, 2, 2) under 1F1B:

    stage 0: F0 [0, 2]  F1 [2, 3]  B0 [8, 12]  F2 [12, 13]  B1 [13, 15]  B2 [16, 18]
    stage 1: F0 [2, 4]  B0 [4, 8]  F1 [8, 9]   B1 [9, 11]   F2 [13, 14]  B2 [14, 16]

step 18: stage 0 idles from 3 to 8 for the long micro-batch's backward. The same micro-batches in the order
6, 12, 6 end at 16 (stage 0: F0 [0, 1] F1 [1, 3] B0 [4, 6] F2 [6, 7] B1 [10, 14] B2 [14, 16]; stage 1: F0
[1, 2] B0 [2, 4] F1 [4, 6] B1 [6, 10] F2 [10, 11] B2 [11, 13]): stage 0 runs F2 while it waits for the long
backward. Busy 12 per rank: bubbles 1/3 and 1/4.

>>> s3 = Schedule.from_blocks([[Block(0, 1, (g,))] for g in (0, 1, 2)], lengths=[12, 6, 6], n_ranks=1,
...                           max_seqlen_per_rank=12, cost=CostModel(quadratic=0.0, linear=1.0))
>>> [simulate_execution(s3, s3.cost, Execution.pipeline(2)).step_time,
...  simulate_execution(with_microbatch_order(s3, [1, 0, 2]), s3.cost, Execution.pipeline(2)).step_time]
[18.0, 16.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.plan.cost import CostModel
from harness.plan.errors import PlanInputError
from harness.plan.pipeline_schedule import check_pipeline, chunk_index, replay, stage_actions

if TYPE_CHECKING:  # layout.py stores an Execution on every Schedule
    from harness.plan.layout import Schedule

EXECUTION_KINDS = ("independent", "synchronous", "pipeline")
PIPELINE_SCHEDULES = ("afab", "1f1b", "interleaved")


class ExecutionError(PlanInputError):
    """An execution model that cannot be simulated (names the value and the fix)."""


@dataclass(frozen=True, kw_only=True)
class Execution:
    """What synchronises the ranks while a schedule runs (see the module doc); frozen, hashable."""

    kind: str = "independent"
    """``independent``, ``synchronous`` or ``pipeline``."""
    pp: int = 1
    """Pipeline stages (``pipeline`` only)."""
    vpp: int = 1
    """Virtual chunks per stage; > 1 runs the interleaved 1F1B schedule."""
    schedule: str = "1f1b"
    """``1f1b`` or ``afab``; with vpp > 1 ``1f1b`` means the interleaved schedule (``interleaved`` is
    accepted as its name), as in the training runtime's ``PipelineConfig``."""
    group: int | None = None
    """``microbatch_group_size_per_vp_stage`` of the interleaved schedule (default pp)."""
    forward_share: float = 1 / 3
    """Share of a micro-batch's (forward + backward) time spent in the forward; the backward gets the rest."""
    chunk_shares: tuple[float, ...] | None = None
    """Share of the model in each model chunk ``c = v * pp + s`` (normalised); None: ``1 / (pp * vpp)`` each."""

    def __post_init__(self) -> None:
        if self.kind not in EXECUTION_KINDS:
            raise ExecutionError(f"unknown execution kind {self.kind!r}; choose from {', '.join(EXECUTION_KINDS)}")
        for name in ("pp", "vpp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ExecutionError(f"Execution.{name} must be a positive int, got {v!r}")
        if self.kind != "pipeline":
            if self.pp != 1 or self.vpp != 1:
                raise ExecutionError(f"pp={self.pp}, vpp={self.vpp} with execution kind {self.kind!r}: stages need "
                                     f"kind 'pipeline'; use Execution.pipeline({self.pp}, vpp={self.vpp})")
            return
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ExecutionError(f"unknown pipeline schedule {self.schedule!r}; choose from "
                                 f"{', '.join(PIPELINE_SCHEDULES)}")
        if self.vpp > 1 and self.pp == 1:
            raise ExecutionError(f"vpp={self.vpp} needs pipeline stages: use pp >= 2, or vpp=1")
        if self.vpp > 1 and self.schedule == "afab":
            raise ExecutionError(f"schedule 'afab' has no virtual chunks, got vpp={self.vpp}; use schedule='1f1b' "
                                 f"(the interleaved 1F1B) with vpp > 1, or vpp=1")
        if self.vpp == 1 and self.schedule == "interleaved":
            raise ExecutionError("schedule 'interleaved' needs vpp >= 2 virtual chunks per stage; use vpp=2 or "
                                 "schedule='1f1b'")
        if self.group is not None and (self.vpp == 1 or not isinstance(self.group, int) or self.group < 1):
            raise ExecutionError(f"group={self.group!r} is the interleaved schedule's micro-batch group: use a "
                                 f"positive int with vpp > 1, or group=None")
        if not 0.0 < self.forward_share < 1.0:
            raise ExecutionError(f"forward_share must lie strictly between 0 and 1, got {self.forward_share!r} "
                                 f"(1/3: the backward costs twice the forward)")
        if self.chunk_shares is not None:
            self._check_shares()

    def _check_shares(self) -> None:
        sh, C = self.chunk_shares, self.pp * self.vpp
        if len(sh) != C or any(not isinstance(x, (int, float)) or not 0 <= x < float("inf") for x in sh):
            raise ExecutionError(f"chunk_shares must be {C} finite numbers >= 0 (one per model chunk "
                                 f"c = v * pp + s), got {sh!r}")
        if sum(sh) <= 0:
            raise ExecutionError(f"chunk_shares {sh!r} sum to 0; give each chunk its layer count or leave None")

    @classmethod
    def pipeline(cls, pp: int, *, vpp: int = 1, schedule: str = "1f1b", group: int | None = None,
                 forward_share: float = 1 / 3, chunk_shares: Sequence[float] | None = None) -> Execution:
        """``pp`` stages running ``schedule`` (``afab`` / ``1f1b``; interleaved when vpp > 1)."""
        shares = None if chunk_shares is None else tuple(chunk_shares)
        return cls(kind="pipeline", pp=pp, vpp=vpp, schedule=schedule, group=group, forward_share=forward_share,
                   chunk_shares=shares)

    @property
    def pipeline_kind(self) -> str:
        """The ``stage_actions`` kind: ``afab``, ``1f1b`` or ``interleaved``."""
        return "interleaved" if self.vpp > 1 else self.schedule

    @property
    def vpp_group(self) -> int | None:
        """The micro-batch count must be a multiple of this (interleaved only), as in ``schedule(vpp_group=)``."""
        return (self.group or self.pp) if self.vpp > 1 else None

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    def shares(self) -> tuple[float, ...]:
        """Normalised share of the model in each model chunk ``c = v * pp + s``."""
        if self.chunk_shares is None:
            return (1.0 / self.num_chunks,) * self.num_chunks
        total = float(sum(self.chunk_shares))
        return tuple(x / total for x in self.chunk_shares)

    def stage_share(self, stage: int) -> float:
        """Share of the model a stage runs (its virtual chunks)."""
        sh = self.shares()
        return sum(sh[chunk_index(stage, v, self.pp)] for v in range(self.vpp))

    def share_before(self, stage: int) -> float:
        """Share of the model in the chunks before the stage's first chunk (``c < stage``): the forward of a
        micro-batch runs them before the stage can start it, its backward runs them after the stage ends it."""
        return sum(self.shares()[:stage])

    def describe(self) -> str:
        if self.kind != "pipeline":
            return self.kind
        return f"pipeline pp {self.pp}" + (f" x vpp {self.vpp}" if self.vpp > 1 else "") + f", {self.pipeline_kind}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["chunk_shares"] = None if self.chunk_shares is None else list(self.chunk_shares)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Execution:
        d = dict(d)
        if d.get("chunk_shares") is not None:
            d["chunk_shares"] = tuple(d["chunk_shares"])
        return cls(**d)


INDEPENDENT = Execution()
SYNCHRONOUS = Execution(kind="synchronous")
NAMED: dict[str, Execution] = {"independent": INDEPENDENT, "synchronous": SYNCHRONOUS}
"""Execution models that a name alone selects (``resolve_execution``); the pipeline needs its sizes."""


class UnknownExecutionError(ExecutionError):
    """An execution model name that is not known, or one that needs parameters a name cannot give."""


def resolve_execution(execution: Execution | str | None, default: Execution = INDEPENDENT) -> Execution:
    """``execution`` as an ``Execution``: an ``Execution`` as is, a name of ``NAMED`` (``"independent"``,
    ``"synchronous"``), None -> ``default``. ``"pipeline"`` needs its sizes: ``Execution.pipeline(pp, vpp=,
    schedule=)``.

    >>> resolve_execution("synchronous").describe(), resolve_execution(None).describe()
    ('synchronous', 'independent')
    >>> resolve_execution("pipeline")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    harness.plan.execution.UnknownExecutionError: execution 'pipeline' needs its stage count: ...
    """
    if execution is None:
        return default
    if isinstance(execution, Execution):
        return execution
    if isinstance(execution, str):
        key = execution.strip().lower()
        if key in NAMED:
            return NAMED[key]
        if key == "pipeline":
            raise UnknownExecutionError("execution 'pipeline' needs its stage count: pass Execution.pipeline(pp, "
                                        "vpp=1, schedule='1f1b') (from harness.plan), not the name")
        raise UnknownExecutionError(f"unknown execution model {execution!r}; choose one of "
                                    f"{', '.join(repr(k) for k in NAMED)} or Execution.pipeline(pp, vpp=, schedule=)")
    raise UnknownExecutionError(f"execution must be an Execution or one of {', '.join(repr(k) for k in NAMED)}, "
                                f"got {execution!r} ({type(execution).__name__}); e.g. execution='synchronous' or "
                                f"Execution.pipeline(2)")


def shares_from_layers(chunks: Sequence[Sequence[int | Sequence[int]]]) -> tuple[float, ...]:
    """``chunk_shares`` in model-chunk order from per-stage, per-virtual-chunk layer counts (``chunks[s][v]`` an
    int, a ``(start, n)`` pair of ``layer_ranges`` or a list of layers as in a timeline's ``chunks``).

    >>> shares_from_layers([[1, 3], [2, 2]])  # c = v * pp + s: (s0 v0, s1 v0, s0 v1, s1 v1)
    (1, 2, 3, 2)
    """
    pp, vpp = len(chunks), len(chunks[0]) if chunks else 0
    if not pp or any(len(row) != vpp for row in chunks):
        raise ExecutionError(f"layers per chunk must be one list of the same length per stage, got {chunks!r}")

    def count(x):
        return x if isinstance(x, int) else x[1] if isinstance(x, tuple) and len(x) == 2 else len(x)

    return tuple(count(chunks[c % pp][c // pp]) for c in range(pp * vpp))


def with_microbatch_order(schedule: Schedule, order: Sequence[int]) -> Schedule:
    """The same micro-batches run in another order (``order[i]`` = the micro-batch that runs i-th)."""
    if sorted(order) != list(range(schedule.num_microbatches)):
        raise ExecutionError(f"order {list(order)!r} is not a permutation of the {schedule.num_microbatches} "
                             f"micro-batches; list each index 0..{schedule.num_microbatches - 1} once")
    return dataclasses.replace(schedule, layout=tuple(schedule.layout[i] for i in order))


# ------------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class PassTime:
    """One simulated pass of one CP block: (stage, block) ran ``kind`` of ``microbatch`` on virtual ``chunk``."""

    stage: int
    start_position: int
    size: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Simulation:
    """Result of ``simulate``: the step time and, per rank, time busy and time spent waiting (for block
    partners, for a pipeline's input, or at a barrier). Ranks are stage-major: ``stage * n + position``."""

    step_time: float
    busy: list[float]
    waiting: list[float]
    stages: int = 1
    passes: tuple[PassTime, ...] = ()
    """Pipeline executions only: every block's passes, in simulation order."""

    @property
    def bubble_fraction(self) -> float:
        """Share of the ranks' time not spent computing: ``1 - sum(busy) / (ranks * step_time)``."""
        if not self.busy or self.step_time <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)


# -------------------------------------------------------------------------------------- simulators
def _independent(schedule: Schedule, cost: CostModel, _: Execution) -> Simulation:
    n = schedule.n_ranks
    free, busy, wait = [0.0] * n, [0.0] * n, [0.0] * n
    for mb in schedule.layout:
        for b in mb:
            lo, hi = b.start, b.start + b.size
            start = max(free[lo:hi])
            dur = schedule.block_cost(b, cost)
            for r in range(lo, hi):
                wait[r] += start - free[r]
                busy[r] += dur
                free[r] = start + dur
    return Simulation(max(free, default=0.0), busy, wait)


def _synchronous(schedule: Schedule, cost: CostModel, _: Execution) -> Simulation:
    n = schedule.n_ranks
    busy, wait, t = [0.0] * n, [0.0] * n, 0.0
    for m in range(schedule.num_microbatches):
        load = schedule.load(m, cost)
        slowest = max(load, default=0.0)
        for r, x in enumerate(load):
            busy[r] += x
            wait[r] += slowest - x  # at the barrier that ends the micro-batch
        t += slowest
    return Simulation(t, busy, wait)


def _pipeline(schedule: Schedule, cost: CostModel, ex: Execution) -> Simulation:
    n, pp, M = schedule.n_ranks, ex.pp, schedule.num_microbatches
    if M == 0:
        return Simulation(0.0, [0.0] * (n * pp), [0.0] * (n * pp), stages=pp)
    check_pipeline(ex.pipeline_kind, pp, M, ex.vpp, ex.vpp_group)
    plans = [stage_actions(ex.pipeline_kind, pp=pp, stage=s, num_microbatches=M, vpp=ex.vpp, group=ex.vpp_group)
             for s in range(pp)]
    shares, last = ex.shares(), ex.num_chunks - 1
    phase = {"F": ex.forward_share, "B": 1.0 - ex.forward_share}
    costs = [[schedule.block_cost(b, cost) for b in mb] for mb in schedule.layout]
    free = [[0.0] * n for _ in range(pp)]
    busy, wait = [0.0] * (n * pp), [0.0] * (n * pp)
    ends: dict[tuple[str, int, int], list[float]] = {}  # (kind, m, model chunk) -> end per block of m
    passes = []
    for s, a in replay(plans, pp, ex.vpp):  # every pass after its stage predecessor and its input
        m, c = a.microbatch, chunk_index(s, a.chunk, pp)
        need = _input(a.kind, m, c, last)
        out = []
        for i, b in enumerate(schedule.layout[m]):
            ranks = b.ranks
            start = max(ends[need][i] if need else 0.0, max(free[s][r] for r in ranks))
            end = start + costs[m][i] * shares[c] * phase[a.kind]
            for r in ranks:
                wait[s * n + r] += start - free[s][r]
                busy[s * n + r] += end - start
                free[s][r] = end
            out.append(end)
            passes.append(PassTime(s, b.start, b.size, a.kind, m, a.chunk, start, end))
        ends[(a.kind, m, c)] = out
    step = max(max(row, default=0.0) for row in free)
    return Simulation(step, busy, wait, stages=pp, passes=tuple(passes))


def _input(kind: str, m: int, c: int, last: int) -> tuple[str, int, int] | None:
    """The pass whose result a pass waits for (same position): see the module doc, rule (b)."""
    if kind == "F":
        return ("F", m, c - 1) if c > 0 else None
    return ("F", m, c) if c == last else ("B", m, c + 1)


SIMULATORS: dict[str, Callable[[Schedule, CostModel, Execution], Simulation]] = {
    "independent": _independent, "synchronous": _synchronous, "pipeline": _pipeline,
}


def check_execution(execution) -> Execution:
    """``execution`` if it is an ``Execution``, else ``ExecutionError`` naming it."""
    if not isinstance(execution, Execution):
        raise ExecutionError(f"execution must be an Execution (INDEPENDENT, SYNCHRONOUS or Execution.pipeline(pp, "
                             f"vpp=, schedule=)), got {execution!r}")
    return execution


def simulate_execution(schedule: Schedule, cost: CostModel, execution: Execution) -> Simulation:
    """Simulate ``schedule`` under ``cost`` and ``execution`` (``harness.plan.bounds.simulate`` is the public
    entry; it defaults the cost and the execution)."""
    return SIMULATORS[check_execution(execution).kind](schedule, cost, execution)


# -------------------------------------------------------------------------------------- lower bounds
@dataclass(frozen=True, kw_only=True)
class BoundTerms:
    """What ``harness.plan.bounds.lower_bound`` knows of any valid schedule of a batch, in the independent
    model; each is a lower bound on some rank's *busy* time, so it scales with a stage's share."""

    busy: float
    """The independent lower bound (every term of it bounds some rank's busy time)."""
    chain: float
    """The per-rank cost of the block that holds the costliest sequence, at least."""
    smallest_block: float
    """The least per-rank cost of any block (every rank runs a sequence in every micro-batch: coverage)."""


def _bound_unchanged(t: BoundTerms, _: Execution) -> float:
    """Independent: the bound itself. Synchronous: barriers only delay blocks (every block starts no earlier
    than in the independent model, by induction over micro-batches), so the same bound holds."""
    return t.busy


def _bound_pipeline(t: BoundTerms, ex: Execution) -> float:
    """``max(max_s [w_s * busy + A_s * smallest_block], chain)`` with ``w_s`` the stage's share of the model and
    ``A_s`` the share of the chunks before its first one (see ``harness.plan.bounds``)."""
    stages = max(ex.stage_share(s) * t.busy + ex.share_before(s) * t.smallest_block for s in range(ex.pp))
    return max(stages, t.chain)


BOUNDS: dict[str, Callable[[BoundTerms, Execution], float]] = {
    "independent": _bound_unchanged, "synchronous": _bound_unchanged, "pipeline": _bound_pipeline,
}


def execution_bound(terms: BoundTerms, execution: Execution) -> float:
    """The lower bound under ``execution`` from the independent model's ``terms``."""
    return BOUNDS[check_execution(execution).kind](terms, execution)


__all__ = ["BOUNDS", "EXECUTION_KINDS", "INDEPENDENT", "NAMED", "SIMULATORS", "SYNCHRONOUS", "BoundTerms",
           "Execution", "ExecutionError", "PassTime", "Simulation", "UnknownExecutionError", "check_execution",
           "execution_bound", "resolve_execution", "shares_from_layers", "simulate_execution",
           "with_microbatch_order"]
