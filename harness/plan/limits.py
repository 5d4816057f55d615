"""The largest inputs the planning layer accepts, each with the reason for its bound.

The schedulers keep state per rank of the DP x CP domain and per sequence, and a schedule holds every
micro-batch's blocks, so memory and time grow with ``n_ranks`` and with sequences x ranks. These
bounds refuse a size before anything is allocated (``SizeLimitError``, a ``PlanInputError``); the
command line uses the same numbers for its options.

>>> check_ranks(4096)
>>> check_ranks(1 << 40)
Traceback (most recent call last):
...
harness.plan.errors.SizeLimitError: n_ranks=1099511627776 exceeds the limit 65536 (the schedulers keep state per rank; the largest dynamic-CP deployments have ~12k GPUs)
"""

from __future__ import annotations

from harness.plan.errors import SizeLimitError

MAX_RANKS = 1 << 16
WHY_RANKS = "the schedulers keep state per rank; the largest dynamic-CP deployments have ~12k GPUs"

MAX_SEQUENCES = 1 << 20
WHY_SEQUENCES = "sequences of one global batch; the schedulers are benchmarked up to 32768"

MAX_LENGTH = 1 << 24
WHY_LENGTH = "tokens; 16M is well past the longest contexts trained"

MAX_WORK = 1 << 27
WHY_WORK = ("a schedule holds a block per rank of every micro-batch; the largest size benchmarked is 4096 ranks x "
            "32768 sequences")


def check_ranks(n_ranks: int, name: str = "n_ranks") -> None:
    """``SizeLimitError`` when ``n_ranks`` (an int) exceeds ``MAX_RANKS``; other checks are ``check_domain``'s."""
    if isinstance(n_ranks, int) and n_ranks > MAX_RANKS:
        raise SizeLimitError(f"{name}={n_ranks} exceeds the limit {MAX_RANKS} ({WHY_RANKS})")


def check_work(sequences: int, n_ranks: int) -> None:
    """``SizeLimitError`` when a batch of ``sequences`` is too many, alone or with ``n_ranks`` ranks."""
    if sequences > MAX_SEQUENCES:
        raise SizeLimitError(f"{sequences} sequences exceed the limit {MAX_SEQUENCES} ({WHY_SEQUENCES}); "
                             f"schedule fewer per global batch")
    if sequences * n_ranks > MAX_WORK:
        raise SizeLimitError(f"{sequences} sequences x {n_ranks} ranks = {sequences * n_ranks} exceeds the limit "
                             f"{MAX_WORK} ({WHY_WORK}); use at most {MAX_WORK // n_ranks} sequences on {n_ranks} "
                             f"ranks, or fewer ranks")
