"""Group layout arithmetic and the block -> process group check (no world needed)."""

from __future__ import annotations

import pytest

from harness.parallel.groups import GroupError, ParallelLayout, check_block
from harness.plan import PlanInputError


def test_megatron_rank_order_tp_fastest_then_cp_then_dp():
    layout = ParallelLayout(dp=2, cp=2, tp=2)
    assert [layout.position(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.dp_cp_ranks(0) == [0, 2, 4, 6] and layout.dp_cp_ranks(1) == [1, 3, 5, 7]
    assert layout.block_ranks(rank=7, size=2) == [5, 7] and layout.block_ranks(rank=2, size=4) == [0, 2, 4, 6]
    with pytest.raises(PlanInputError, match="dp must be a positive int"):
        ParallelLayout(dp=0, cp=1)


@pytest.mark.parametrize("start, size, sizes, match", [
    (2, 4, [1, 2, 4, 8], "starts at position 2, not a multiple of 4"),
    (0, 2, [4, 8], "block of size 2 at position 0 has no process group"),
    (0, 3, [1, 2, 4], "size 3"),
])
def test_blocks_without_a_group_are_errors(start, size, sizes, match):
    with pytest.raises(GroupError, match=match) as e:
        check_block(start, size, sizes, "micro-batch 3")
    assert "micro-batch 3" in str(e.value) and isinstance(e.value, ValueError)
    check_block(4, 4, [1, 2, 4, 8])
