"""Differential suite: the installed megatron-core 0.16.1 scheduler against our models.

megatron-core 0.16.1 ships the part-1 design (``BalancedCPScheduler``). ``megatron-pr2000`` differs
from it in exactly two named ways, both flags of ``schedule_pr2000``:

- ``capacity_check``: PR #2000 lets a sequence join a same-size group only while
  ``packed + L/cp <= max_seqlen_per_rank``; part 1 has no check (so it breaks the capacity
  invariant, see ``test_upstream_defects``).
- ``trim_overload``: part 1 drops the last sequence of the most-loaded group while that narrows
  the load spread, appending it unsorted to the leftovers.

The properties: upstream equals our model with (capacity_check=False, trim_overload=True) exactly, on
every input; and each flag alone changes the schedule on a pinned input, so both differences are
real and they are the only ones. ``megatron-dev`` and the VPP alignment exist in no megatron-core
release installable on Python 3.11; the spec's vectors (produced by running that code) pin them in
``suites/plan/test_parity_vectors.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from harness.plan import schedule
from harness.plan.megatron_pr2000 import PART1, schedule_pr2000
from harness.testing import batches
from harness.upstream import megatron

pytestmark = pytest.mark.upstream


def _ours(batch, **flags):
    blocks = schedule_pr2000(batch.lengths, batch.n_ranks, batch.max_seqlen_per_rank, **flags)
    return [[list(ids) for size, ids in mb for _ in range(size)] for mb in blocks]


def _upstream(batch):
    return megatron.sample_id_groups(batch.lengths, n_ranks=batch.n_ranks,
                                     max_seqlen_per_rank=batch.max_seqlen_per_rank)


@given(batch=batches(min_cp=False, vpp=False, max_sequences=64))
def test_upstream_equals_the_part1_model(batch):
    assert _upstream(batch) == _ours(batch, **PART1)


@given(batch=batches(min_cp=False, vpp=False))
def test_megatron_pr2000_is_the_model_without_the_two_differences(batch):
    ours = schedule(batch.lengths, algorithm="megatron-pr2000", n_ranks=batch.n_ranks,
                    max_seqlen_per_rank=batch.max_seqlen_per_rank).microbatches
    assert ours == _ours(batch, capacity_check=True, trim_overload=False)


class _B:  # a pinned batch
    def __init__(self, lengths, n, mslpr):
        self.lengths, self.n_ranks, self.max_seqlen_per_rank = list(enumerate(lengths)), n, mslpr


def test_capacity_check_is_a_real_difference():
    b = _B([13, 12], 2, 8)  # both cp2; part 1 packs 25 tokens on 2 ranks of 8
    assert _upstream(b) == [[[0, 1], [0, 1]]]
    assert _ours(b, capacity_check=False, trim_overload=False) == [[[0, 1], [0, 1]]]
    assert _ours(b, capacity_check=True, trim_overload=False) == [[[0], [0]], [[1], [1]]]


def test_trim_overload_is_a_real_difference():
    b = _B([27, 27, 19, 6, 61, 56, 60, 26, 29], 8, 16)
    assert _upstream(b) == _ours(b, **PART1)
    assert _ours(b, capacity_check=False, trim_overload=True) != _ours(b, capacity_check=False, trim_overload=False)
