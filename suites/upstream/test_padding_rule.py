"""The padding the schedulers price against the installed megatron-core's own rule.

``megatron.core.models.multimodal.context_parallel.get_padding`` pads a sequence to a multiple of ``tp x cp x 2``
under CP with sequence parallelism, ``cp x 2`` under CP alone, ``tp`` under SP alone; the harness's
``SequencePadding`` (what ``balanced`` and ``dp-balanced`` fit to a block's capacity, and the divisor the runtime pads
by, ``harness.plan.thd.padding_divisor``) must agree with it for every block size, TP size and length.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.plan.padding import SequencePadding
from harness.plan.thd import pad_length, padding_divisor

pytestmark = pytest.mark.upstream


def _upstream(L: int, cp: int, tp: int, sp: bool) -> int:
    from megatron.core.models.multimodal.context_parallel import get_padding

    return L + get_padding(L, cp, tp, sp)


@given(L=st.integers(1, 1 << 20), cp=st.sampled_from([1, 2, 4, 8, 64]), tp=st.sampled_from([1, 2, 4, 8]),
       sp=st.booleans())
def test_the_priced_padding_is_megatrons(L, cp, tp, sp):
    mine = SequencePadding(tp=tp if sp else 1)
    want = _upstream(L, cp, tp, sp)
    assert mine.padded(L, cp) == want
    assert pad_length(L, padding_divisor(cp_size=cp, tp_size=tp, sequence_parallel=sp)) == want  # the runtime's


def test_domain_padding_is_megatrons_at_the_whole_domain():
    """Dynamic CP pads before the schedule exists: every sequence as for a CP group of the whole domain."""
    for L in (1, 7, 100, 4097):
        for n, tp in ((4, 1), (8, 2), (16, 8)):
            assert SequencePadding(tp=tp, domain=n).padded(L, 1) == _upstream(L, n, tp, tp > 1)
