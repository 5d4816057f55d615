"""The three training layouts of a global batch, as schedules of CP blocks plus a padding rule.

- ``bshd``: every sequence padded to the batch's longest (rounded to ``2 * C``), static CP of
  ``C`` ranks, ``N / C`` data-parallel replicas; replica d takes a contiguous share of the batch in
  micro-batches of ``micro_batch_size`` sequences (Megatron's padded pretraining path).
- ``thd``: sequences packed by ``dp-balanced`` (static CP ``C``, each sequence padded to ``2 * C``).
- ``dcp``: dynamic CP with a scheduler by name (default ``balanced``; ``megatron-core``: the installed
  megatron-core's own ``BalancedCPScheduler``, ``harness.upstream.megatron``); padding ``local``
  (``2 * local_cp_size``, knowing the schedule) or ``domain`` (Megatron's ``2 * N``).
``C`` is the static CP size: the smallest power of two whose ranks hold the run's longest sequence.
All three run the same THD runtime: a bshd micro-batch is a THD pack whose sequences share one
padded length, which is a ``[B, S]`` batch with a causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from harness.plan import CostModel, Schedule, check_schedule, cp_min, schedule
from harness.plan.api import PADDED
from harness.plan.errors import LayoutError
from harness.plan.execution import resolve_execution
from harness.plan.layout import Block
from harness.plan.padding import SequencePadding
from harness.plan.thd import pad_length, padding_divisor
from harness.upstream import megatron as upstream

LAYOUTS = ("bshd", "thd", "dcp")


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    n_ranks: int
    """DP x CP positions (the world, without TP/PP)."""
    max_seqlen_per_rank: int
    """Tokens one rank may hold in a micro-batch (dynamic CP); also sizes the static CP."""
    static_cp: int
    """CP size of bshd and thd."""
    micro_batch_size: int = 1
    """Sequences per bshd micro-batch."""
    scheduler: str = "balanced"
    """Dynamic-CP scheduler (``harness.plan.ALGORITHMS``)."""
    dcp_padding: str = "local"
    """``local`` (2 x local_cp_size) or ``domain`` (2 x N, Megatron)."""
    vpp_group: int | None = None
    """Micro-batch counts must be a multiple of this (the interleaved pipeline schedule's group)."""
    execution: object = None
    """The execution model the thd and dcp schedules are made for (``harness.plan.Execution`` or its name;
    None: independent); ``TrainConfig.execution_model`` picks it."""
    microbatch_tokens_per_rank: int | None = None
    """``balanced``'s capacity of a rank in one micro-batch (``harness.plan.api.schedule``); None:
    ``max_seqlen_per_rank``. For a stack that runs each sequence of a micro-batch as its own pass."""
    tp_padding: int = 1
    """The TP size under sequence parallelism (else 1): every sequence is padded to a multiple of it times its CP
    divisor, and the thd / dcp schedules price that padding in their capacity (``harness.plan.padding``)."""
    expert_parallel: bool = False
    """MoE experts sharded over the domain (``harness.parallel.expert_parallel``): their gradients are complete
    on their owner and are not all-reduced."""


def static_cp_for(longest: int, cfg_n_ranks: int, max_seqlen_per_rank: int) -> int:
    c = cp_min(longest, max_seqlen_per_rank)
    if c > cfg_n_ranks:
        raise LayoutError(f"the longest sequence ({longest} tokens) needs a static CP group of {c} ranks at "
                          f"max_seqlen_per_rank={max_seqlen_per_rank}, but the world has {cfg_n_ranks} (DP x CP "
                          f"ranks of a pipeline stage); use a world of >= {c} such ranks, raise max_seqlen_per_rank "
                          f"to >= {-(-longest // cfg_n_ranks)}, or shorten the sequences")
    return c


def plan(layout: str, lengths: list[int], cfg: LayoutConfig, cost: CostModel | None = None) -> tuple[Schedule, str, int]:
    """(schedule, padding mode, fixed padded length or 0) of one global batch under ``layout``."""
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    C, N = cfg.static_cp, cfg.n_ranks
    if layout == "thd":
        return schedule(lengths, n_ranks=N, max_seqlen_per_rank=cfg.max_seqlen_per_rank, min_cp_size=C,
                        vpp_group=cfg.vpp_group, algorithm="dp-balanced", execution=cfg.execution,
                        padding=SequencePadding(tp=cfg.tp_padding)), "local", 0
    if layout == "dcp" and cfg.scheduler == upstream.NAME:
        return upstream_schedule(lengths, cfg), cfg.dcp_padding, 0
    if layout == "dcp":
        padding = SequencePadding(tp=cfg.tp_padding, domain=N if cfg.dcp_padding == "domain" else None) \
            if cfg.scheduler in PADDED else None  # the Megatron algorithms take lengths as given, as upstream's do
        return schedule(lengths, n_ranks=N, max_seqlen_per_rank=cfg.max_seqlen_per_rank, algorithm=cfg.scheduler,
                        vpp_group=cfg.vpp_group, cost=cost, execution=cfg.execution,
                        microbatch_tokens_per_rank=cfg.microbatch_tokens_per_rank, padding=padding), cfg.dcp_padding, 0
    dp, mbs, n = N // C, cfg.micro_batch_size, len(lengths)
    if n % (dp * mbs):
        raise LayoutError(f"bshd splits the global batch into {dp} data-parallel replicas x micro-batches of "
                          f"{mbs}: {n} sequences is not a multiple of {dp * mbs}; use a global batch of a "
                          f"multiple of {dp * mbs} sequences or another micro_batch_size")
    share = n // dp
    if cfg.vpp_group and (share // mbs) % cfg.vpp_group:
        raise LayoutError(f"bshd gives each data-parallel replica {share // mbs} micro-batches, not a multiple of the "
                          f"interleaved pipeline's group {cfg.vpp_group}; use a global batch of a multiple of "
                          f"{dp * mbs * cfg.vpp_group} sequences")
    mbs_layout = [[Block(d * C, C, tuple(range(d * share + m * mbs, d * share + (m + 1) * mbs))) for d in range(dp)]
                  for m in range(share // mbs)]
    longest = pad_length(max(lengths), padding_divisor(cp_size=C))
    return Schedule.from_blocks(mbs_layout, lengths=lengths, n_ranks=N,
                                max_seqlen_per_rank=max(cfg.max_seqlen_per_rank, longest * mbs // C),
                                vpp_group=cfg.vpp_group, algorithm="bshd",
                                execution=resolve_execution(cfg.execution)), "fixed", longest


def for_stack(cfg: LayoutConfig, lengths, sequence_passes: bool, execution: str | None = None) -> LayoutConfig:
    """The config a stack's batch of ``lengths`` is planned with: for a stack that runs every sequence of a micro-batch
    as its own pass (``harness.stack.protocol.sequence_passes``) ``balanced`` packs a micro-batch by the batch's tokens
    (``max_seqlen_per_rank`` bounds each sequence, as in megatron-core's hybrid CP, whose own scheduler overfills a
    rank); a stack that declares its ``execution`` model (``harness.stack.protocol.declared_execution``) is scheduled
    for it unless the run has its own (a pipeline, expert parallelism). Any other stack plans as ``cfg`` says."""
    if execution and resolve_execution(cfg.execution).kind == "independent":
        cfg = replace(cfg, execution=execution)
    if not sequence_passes or cfg.scheduler != "balanced":
        return cfg
    return replace(cfg, microbatch_tokens_per_rank=max(cfg.max_seqlen_per_rank, sum(int(L) for L in lengths)))


UPSTREAM_LIBERTIES = frozenset({"capacity", "cp-min", "coverage", "block-order"})
"""Invariants of the harness's schedulers that megatron-core's own scheduler does not keep (it may overfill a
rank, leave one idle in a micro-batch, order blocks freely): a run of it goes as upstream's would. Every other
invariant (each sequence once, in one contiguous block of a group that exists) is enforced."""


def upstream_schedule(lengths: list[int], cfg: LayoutConfig) -> Schedule:
    """The installed megatron-core's own scheduler (``BalancedCPScheduler.get_groups_and_subsamples``, as its
    ``HybridCPDataLoaderWrapper`` calls it) on one global batch, validated like the harness's own schedules."""
    if not upstream.available():
        raise LayoutError("scheduler 'megatron-core' runs the installed megatron-core's own scheduler, and "
                          "megatron-core cannot be imported here: pip install megatron-core (the README's GPU section "
                          "for 0.19), or choose another scheduler")
    try:
        sched = upstream.schedule(lengths, n_ranks=cfg.n_ranks, max_seqlen_per_rank=cfg.max_seqlen_per_rank,
                                  vpp_group=cfg.vpp_group)
    except upstream.UnsupportedByUpstream as e:
        raise LayoutError(f"scheduler 'megatron-core': {e}; use --scheduler megatron-dev (its parity mode)") from e
    sched = replace(sched, execution=resolve_execution(cfg.execution))
    check_runnable(sched)  # upstream's output is checked, never trusted: one that cannot run is an error
    return sched


def check_runnable(sched: Schedule) -> None:
    """``ScheduleError`` for the first violated invariant (``validate_schedule``); a schedule of megatron-core's own
    scheduler is held to every invariant but ``UPSTREAM_LIBERTIES``."""
    free = UPSTREAM_LIBERTIES if sched.algorithm == upstream.NAME else frozenset()
    hard = [v for v in check_schedule(sched) if v.invariant not in free]
    if hard:
        raise hard[0].error()


def sample_id_groups(sched: Schedule) -> list[list[list[int]]]:
    """The schedule as Megatron hands it to every rank: micro-batch -> slot -> gids, one fresh list
    per slot (``sample_id_groups``)."""
    return [[list(b.gids) for b in mb for _ in range(b.size)] for mb in sched.layout]


def deliver(sched: Schedule) -> Schedule:
    """What every rank runs: the blocks it rebuilds from the ``sample_id_groups`` it was handed
    (``Schedule.from_microbatches``), validated (``validate_schedule`` raises ``ScheduleError``
    naming the invariant, micro-batch and ranks before any rank runs a wrong block)."""
    out = Schedule.from_microbatches(sample_id_groups(sched), lengths=list(sched.lengths.items()), n_ranks=sched.n_ranks,
                                     max_seqlen_per_rank=sched.max_seqlen_per_rank, min_cp_size=sched.min_cp_size,
                                     vpp_group=sched.vpp_group, algorithm=sched.algorithm, cost=sched.cost,
                                     execution=sched.execution)
    check_runnable(out)
    return out
