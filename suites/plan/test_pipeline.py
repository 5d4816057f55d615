"""PP / VPP layer ranges and MoE router placement: spec A.4 table, properties, errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.plan import PlanInputError
from harness.plan.pipeline import layer_ranges, moe_layers, routers_on_stage, stage_layers

TABLE = [  # spec A.4, checked against megatron-core's own helpers
    ((27, 2), {"first": 13}, [[(0, 13)], [(13, 14)]]),
    ((27, 2), {"last": 13}, [[(0, 14)], [(14, 13)]]),
    ((48, 4), {}, [[(0, 12)], [(12, 12)], [(24, 12)], [(36, 12)]]),
    ((48, 4), {"first": 10, "last": 10}, [[(0, 10)], [(10, 14)], [(24, 14)], [(38, 10)]]),
    ((48, 4), {"first": 11, "last": 11}, [[(0, 11)], [(11, 13)], [(24, 13)], [(37, 11)]]),
    ((48, 4), {"first": 9}, [[(0, 9)], [(9, 13)], [(22, 13)], [(35, 13)]]),
    ((48, 4), {"last": 6}, [[(0, 14)], [(14, 14)], [(28, 14)], [(42, 6)]]),
    ((30, 4), {"account_embedding": True, "account_loss": True}, [[(0, 7)], [(7, 8)], [(15, 8)], [(23, 7)]]),
    ((61, 8), {"first": 5, "last": 2}, [[(0, 5)], [(5, 9)], [(14, 9)], [(23, 9)], [(32, 9)], [(41, 9)], [(50, 9)], [(59, 2)]]),
    ((8, 2), {"vpp_size": 2}, [[(0, 2), (4, 2)], [(2, 2), (6, 2)]]),
    ((8, 2), {"vpp_size": 4}, [[(0, 1), (2, 1), (4, 1), (6, 1)], [(1, 1), (3, 1), (5, 1), (7, 1)]]),
]


@pytest.mark.parametrize("args, kw, expected", TABLE)
def test_spec_table(args, kw, expected):
    assert layer_ranges(*args, **kw) == expected


@pytest.mark.parametrize("args, kw, match", [
    ((27, 2), {}, r"27 layers = 27 slots cannot be split evenly over pipeline_model_parallel_size=2"),
    ((48, 4), {"first": 10}, r"38 layers left after first=10 / last=None cannot be split evenly over 3 middle stages"),
    ((6, 4), {"first": 4, "last": 2}, r"leave no layers for the 2 middle stages"),
    ((8, 2), {"first": 10}, r"do not fit 8 layers"),
    ((8, 1), {"first": 3}, r"need pipeline_model_parallel_size > 1"),
    ((8, 1), {"vpp_size": 2}, r"virtual pipeline stages need"),
    ((12, 2), {"first": 3, "vpp_size": 2}, r"stage 0 has 3 layers, not divisible by virtual_pipeline_model_parallel_size=2"),
    ((12, 2), {"first": 4, "account_loss": True}, r"cannot be combined"),
    ((0, 2), {}, r"num_layers must be a positive int"),
])
def test_impossible_splits_name_the_numbers(args, kw, match):
    with pytest.raises(PlanInputError, match=match):
        layer_ranges(*args, **kw)


@given(st.integers(1, 8).flatmap(lambda P: st.tuples(
    st.just(P), st.integers(1, 6), st.sampled_from([None, 1, 2]),
    st.one_of(st.none(), st.integers(1, 6)), st.one_of(st.none(), st.integers(1, 6)))))
def test_ranges_partition_all_layers_in_order(args):
    P, per, V, first, last = args
    V = None if P == 1 else V
    n_mid = P - (first is not None) - (last is not None)
    L = (first or 0) + (last or 0) + max(n_mid, 0) * per * (V or 1)
    if P == 1:
        first = last = None
        L = per
    try:
        ranges = layer_ranges(L, P, first=first, last=last, vpp_size=V)
    except PlanInputError:
        return  # impossible combinations are errors (checked above); valid ones below
    flat = sorted((s, n) for st_ in ranges for (s, n) in st_)
    assert [i for s, n in flat for i in range(s, s + n)] == list(range(L))
    assert all(len(st_) == (V or 1) for st_ in ranges)
    if first is not None:
        assert sum(n for _, n in ranges[0]) == first
    if last is not None and P > 1:
        assert sum(n for _, n in ranges[-1]) == last
    for p in range(P):  # a stage's chunks go up in layer order
        starts = [s for s, _ in ranges[p]]
        assert starts == sorted(starts)


def test_moe_layers_and_router_placement():
    assert moe_layers(8, freq=2) == [0, 2, 4, 6]
    assert moe_layers(27, first_dense=1) == list(range(1, 27))  # Moonlight: layer 0 dense
    assert moe_layers(4, freq=[0, 1, 1, 0]) == [1, 2]
    # freq=2, L=8, PP=2: stage 0 builds layers 0..3 with routers at 0 and 2 - not "the last two layers",
    # which is what a dense-layers-first fallback would assume
    assert routers_on_stage(layer_ranges(8, 2)[0], moe_layers(8, freq=2)) == [0, 2]
    moon = layer_ranges(27, 2, first=13)
    assert routers_on_stage(moon[0], moe_layers(27, first_dense=1)) == list(range(1, 13))
    assert routers_on_stage(moon[1], moe_layers(27, first_dense=1)) == list(range(13, 27))
    assert stage_layers(layer_ranges(8, 2, vpp_size=2)[1]) == [2, 3, 6, 7]
    with pytest.raises(PlanInputError, match="zeros/ones"):
        moe_layers(3, freq=[1, 2, 0])
