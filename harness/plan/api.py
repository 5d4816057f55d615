"""``schedule()``: the one entry point to every scheduler.

>>> s = schedule([8192, 4096, 3000, 2048, 1024, 1024, 512, 512, 256], n_ranks=8,
...              max_seqlen_per_rank=2048, algorithm="megatron-pr2000")
>>> s.microbatches[0]
[[0], [0], [0], [0], [1], [1], [2], [2]]
>>> s.local_cp_size(0)
[4, 4, 4, 4, 2, 2, 2, 2]
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from harness.plan.balanced import schedule_balanced
from harness.plan.cost import CostModel, check_microbatch_tokens
from harness.plan.dp_balanced import schedule_dp_balanced
from harness.plan.errors import PlanInputError, UnknownAlgorithmError
from harness.plan.execution import Execution, ExecutionError, resolve_execution
from harness.plan.layout import Schedule, layout_from_sizes
from harness.plan.lengths import check_domain, check_fits, normalize_lengths
from harness.plan.limits import check_ranks, check_work
from harness.plan.megatron_dev import schedule_dev
from harness.plan.megatron_pr2000 import schedule_pr2000
from harness.plan.padding import SequencePadding

# name -> (function(pairs, n_ranks, mslpr, min_cp, vpp, cost, execution) -> blocks per micro-batch, summary)
ALGORITHMS: dict[str, tuple[Callable, str]] = {
    "balanced": (schedule_balanced, "ours: best simulated step under the given execution model and cost (default)"),
    "megatron-pr2000": (lambda p, n, m, c, v, _, __: schedule_pr2000(p, n, m, c, v),
                        "Megatron-LM PR #2000 next_hdp_group, exact"),
    "megatron-dev": (lambda p, n, m, c, v, _, __: schedule_dev(p, n, m, c, v),
                     "Megatron-LM PR #5154 next_hdp_group_packing_aware, exact"),
    "dp-balanced": (lambda p, n, m, c, v, _, __: schedule_dp_balanced(p, n, m, c, v),
                    "Megatron DpBalancedScheduler: static CP, THD packing"),
}

PADDED = ("balanced", "dp-balanced")
"""The algorithms that price a ``SequencePadding`` (``schedule``'s ``padding``)."""


def schedule(lengths, *, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
             vpp_group: int | None = None, algorithm: str = "balanced",
             cost: CostModel | None = None, execution: Execution | str | None = None,
             microbatch_tokens_per_rank: int | None = None, padding: SequencePadding | None = None) -> Schedule:
    """Schedule a global batch onto a DP x CP domain of ``n_ranks`` positions.

    Args:
        lengths: ``(gid, L)`` pairs, or plain ints (gid = index); padded lengths in tokens.
        n_ranks: DP x CP positions (a power of two, at most ``harness.plan.limits.MAX_RANKS``).
        max_seqlen_per_rank: tokens one rank may hold in a micro-batch.
        min_cp_size: smallest CP block (a power of two <= n_ranks); for ``dp-balanced`` the static
            CP size is ``max(min_cp_size, cp_min(longest))``.
        vpp_group: make the micro-batch count a multiple of this (Megatron's
            ``microbatch_group_size_per_vp_stage``); None or 1 = no constraint.
        algorithm: one of ``ALGORITHMS``.
        cost: the cost model ``balanced`` optimises (default: upstream's ``L**2/cp``); the Megatron
            algorithms always use their own estimator. Stored on the schedule for its loads.
        execution: how the step runs, the model ``balanced`` optimises (``harness.plan.execution``): an
            ``Execution`` or its name, ``"independent"`` (default: CP blocks synchronise only their ranks) or
            ``"synchronous"`` (a barrier over the domain after every micro-batch: MoE with expert parallelism);
            a pipeline needs ``Execution.pipeline(pp, vpp=, schedule=)``, whose interleaved micro-batch group
            is the default ``vpp_group``. The Megatron algorithms place sequences as upstream does whatever it
            is (exact parity). Stored on the schedule (``Schedule.execution``): ``simulate``, ``quality``,
            ``stats`` judge it by this model unless told otherwise.
        microbatch_tokens_per_rank: tokens a rank may hold in one micro-batch over its block's sequences (``balanced``
            only; default ``max_seqlen_per_rank``). A stack that runs every sequence of a micro-batch as its own
            forward and backward (megatron-core's hybrid CP) bounds only each sequence: give it a larger capacity
            (the batch's tokens: none) and ``max_seqlen_per_rank`` still sets each sequence's smallest CP.
        padding: how the runtime pads each sequence of a block (``harness.plan.padding.SequencePadding``: by the
            block's CP size, times tp under sequence parallelism); ``balanced`` and ``dp-balanced`` then fit every
            block's *padded* tokens to its capacity and size each sequence by its padded length. None (default):
            ``lengths`` are what the ranks hold. The Megatron algorithms take lengths padded by their caller, as
            upstream's do.
    Raises:
        PlanInputError (a ``ValueError``) subclasses naming the value and the fix; ``SizeLimitError`` for sizes
        past ``harness.plan.limits`` (ranks, sequences, sequences x ranks).
    """
    if algorithm not in ALGORITHMS:
        raise UnknownAlgorithmError(
            f"unknown algorithm {algorithm!r}; choose one of {', '.join(sorted(ALGORITHMS))}"
        )
    ex = resolve_execution(execution)
    check_ranks(n_ranks)  # before anything sized by it is allocated
    check_domain(n_ranks, max_seqlen_per_rank, min_cp_size, vpp_group)
    vpp_group = _group(vpp_group, ex)
    if hasattr(lengths, "__len__") and not isinstance(lengths, (str, bytes)):
        check_work(len(lengths), n_ranks)
    pairs = normalize_lengths(lengths)
    check_work(len(pairs), n_ranks)
    if padding is not None and not isinstance(padding, SequencePadding):
        raise PlanInputError(f"padding must be a harness.plan.SequencePadding (e.g. SequencePadding(tp=8) under "
                             f"sequence parallelism) or None, got {padding!r}")
    check_fits(pairs, n_ranks, max_seqlen_per_rank, padding)
    check_microbatch_tokens(microbatch_tokens_per_rank, max_seqlen_per_rank)
    if microbatch_tokens_per_rank is not None and algorithm != "balanced":
        raise PlanInputError(f"microbatch_tokens_per_rank is a capacity of algorithm 'balanced'; {algorithm!r} "
                             f"packs by max_seqlen_per_rank as upstream does: leave it None or use balanced")
    if padding is not None and algorithm not in PADDED:
        raise PlanInputError(f"padding is priced by {' and '.join(PADDED)}; {algorithm!r} schedules lengths as given, "
                             f"as upstream does: pad the lengths before scheduling (upstream pads every sequence to "
                             f"2 x n_ranks x tp) and leave padding None, or use {PADDED[0]}")
    cost = cost or CostModel.megatron()
    vpp = vpp_group if vpp_group and vpp_group > 1 else None
    fn, _ = ALGORITHMS[algorithm]
    with cyclic_gc_paused():
        if algorithm == "balanced" and (microbatch_tokens_per_rank is not None or padding is not None):
            mbs = schedule_balanced(pairs, n_ranks, max_seqlen_per_rank, min_cp_size, vpp, cost, ex,
                                    microbatch_tokens_per_rank, padding) if pairs else []
        elif algorithm == "dp-balanced" and padding is not None:
            mbs = schedule_dp_balanced(pairs, n_ranks, max_seqlen_per_rank, min_cp_size, vpp, padding) if pairs else []
        else:
            mbs = fn(pairs, n_ranks, max_seqlen_per_rank, min_cp_size, vpp, cost, ex) if pairs else []
        return Schedule(tuple(layout_from_sizes(mb) for mb in mbs), dict(pairs), n_ranks,
                        max_seqlen_per_rank, min_cp_size, vpp_group, algorithm, cost, ex, microbatch_tokens_per_rank,
                        padding)


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block, then restore its state. The schedulers allocate
    ~10^5 small objects at scale (heap entries, blocks) and free them as plain references; the collector's
    passes over them cost ~15% of a 4096-rank schedule and make its latency jumpy. Nothing they build is a
    reference cycle, so nothing is left for the collector to find afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _group(vpp_group: int | None, ex: Execution) -> int | None:
    """The micro-batch multiple: ``vpp_group``, or the interleaved pipeline's group when it is not given;
    one that the pipeline's group does not divide is an error naming both."""
    need = ex.vpp_group
    if not need or need == 1:
        return vpp_group
    if not vpp_group or vpp_group == 1:
        return need
    if vpp_group % need:
        raise ExecutionError(f"vpp_group={vpp_group} is not a multiple of the micro-batch group {need} of "
                             f"execution {ex.describe()!r}; pass vpp_group={need} (or a multiple) or leave it None")
    return vpp_group
