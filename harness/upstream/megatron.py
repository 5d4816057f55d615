"""Run the installed megatron-core scheduler behind ``harness.plan``'s interface.

megatron-core 0.16.1 (the newest release for Python 3.11) ships the *part-1* hybrid-CP design:
``megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler``. Its constructor wants a
``max_seq_len_per_rank`` and a process group, of which it only calls ``.size()``; its
``get_groups_and_subsamples`` is pure Python, so it runs here on CPU as shipped.

It has no ``min_cp_size`` and no VPP alignment: asking for either raises ``UnsupportedByUpstream``
(a ``NotImplementedError``) so that suites can skip those cases by name.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from harness.plan.layout import Schedule
from harness.plan.lengths import normalize_lengths

NAME = "megatron-core"


class UnsupportedByUpstream(NotImplementedError):
    """The installed upstream has no counterpart for the requested option."""


@dataclass(frozen=True)
class _Domain:
    """Stands in for the DP x CP process group: upstream only calls ``.size()``."""

    n: int

    def size(self) -> int:
        return self.n


def _import():
    """Import the scheduler module quietly (megatron warns about missing TE / Apex on import)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.pipeline_parallel.hybrid_cp_schedule as mod
    return mod


def available() -> bool:
    try:
        _import()
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def version() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def scheduler(n_ranks: int, max_seqlen_per_rank: int):
    """A fresh upstream ``BalancedCPScheduler`` for a domain of ``n_ranks`` positions."""
    return _import().BalancedCPScheduler(max_seq_len_per_rank=max_seqlen_per_rank, dp_cp_group=_Domain(n_ranks))


def sample_id_groups(lengths, *, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
                     vpp_group: int | None = None) -> list[list[list[int]]]:
    """Upstream's raw output (micro-batch -> slot -> gids), exactly as returned; no validation."""
    if min_cp_size != 1:
        raise UnsupportedByUpstream(f"megatron-core {version()} has no min_cp_size (asked for {min_cp_size})")
    if vpp_group not in (None, 1):
        raise UnsupportedByUpstream(f"megatron-core {version()} has no VPP alignment (asked for {vpp_group})")
    pairs = [list(p) for p in normalize_lengths(lengths)]
    _, groups = scheduler(n_ranks, max_seqlen_per_rank).get_groups_and_subsamples(pairs, config=None)
    return groups


def schedule(lengths, *, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
             vpp_group: int | None = None) -> Schedule:
    """Upstream's schedule as a ``Schedule`` (not validated: check it with ``check_schedule``)."""
    mbs = sample_id_groups(lengths, n_ranks=n_ranks, max_seqlen_per_rank=max_seqlen_per_rank,
                           min_cp_size=min_cp_size, vpp_group=vpp_group)
    return Schedule.from_microbatches(mbs, lengths=lengths, n_ranks=n_ranks,
                                      max_seqlen_per_rank=max_seqlen_per_rank, algorithm=NAME)
