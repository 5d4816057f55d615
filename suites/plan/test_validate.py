"""The validator names each invariant, the micro-batch and the ranks; a valid schedule passes."""

from __future__ import annotations

import pytest

from harness.plan import INVARIANTS, PlanInputError, ScheduleError, check_schedule, schedule, validate_schedule

L = [(0, 300), (1, 90), (2, 60), (3, 100), (4, 700)]
DOMAIN = dict(n_ranks=4, max_seqlen_per_rank=200)

# (invariant, micro-batches, extra kwargs, expected micro-batch, expected ranks)
CASES = [
    ("slot-count", [[[0], [0], [1]]], {}, 0, ()),
    ("coverage", [[[0], [0], [1, 2], []], [[4]] * 4, [[3]] * 4], {}, 0, (3,)),
    ("block-shape", [[[0], [0], [1, 2], [2, 1]], [[4]] * 4, [[3]] * 4], {}, 0, (2, 3)),
    ("block-shape", [[[0], [0], [1, 1], [2]], [[4]] * 4, [[3]] * 4], {}, 0, (2,)),
    ("exactly-once", [[[0], [0], [1, 2], [3]], [[4]] * 4, [[3]] * 4], {}, 2, (0, 1, 2, 3)),
    ("exactly-once", [[[0], [0], [1, 2], [3]]], {}, None, ()),
    ("exactly-once", [[[0], [0], [1, 2], [3]], [[4, 9]] * 4], {}, 1, (0, 1, 2, 3)),
    ("block-size", [[[0], [0], [0], [1, 2]], [[4]] * 4, [[3]] * 4], {}, 0, (0, 1, 2)),
    ("min-cp", [[[0], [0], [1, 2], [3]], [[4]] * 4], {"min_cp_size": 2}, 0, (2,)),
    ("cp-min", [[[0], [1, 2], [3], [3]], [[4]] * 4], {}, 0, (0,)),
    ("buddy-alignment", [[[1, 2], [0], [0], [3]], [[4]] * 4], {}, 0, (1, 2)),
    ("block-order", [[[1, 2], [3], [0], [0]], [[4]] * 4], {}, 0, (2, 3)),
    ("capacity", [[[0, 1, 3], [0, 1, 3], [2], [2]], [[4]] * 4], {}, 0, (0, 1)),
    ("vpp-multiple", [[[0], [0], [1, 2], [3]], [[4]] * 4, [[3]] * 4], {"vpp_group": 2}, None, ()),
]


@pytest.mark.parametrize("invariant, mbs, kw, mb, ranks", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_invariant_is_named(invariant, mbs, kw, mb, ranks):
    found = [(v.invariant, v.microbatch, v.ranks) for v in check_schedule(mbs, L, **DOMAIN, **kw)]
    assert (invariant, mb, ranks) in found, found
    with pytest.raises(ScheduleError) as e:
        validate_schedule(mbs, L, **DOMAIN, **kw)
    assert f"'{e.value.invariant}'" in str(e.value) and e.value.invariant in INVARIANTS


def test_every_invariant_has_a_case():
    assert {c[0] for c in CASES} == set(INVARIANTS)


def test_valid_schedule_passes_and_error_fields():
    validate_schedule([[[0], [0], [1, 2], [3]], [[4]] * 4], L, **DOMAIN)
    with pytest.raises(ScheduleError) as e:
        validate_schedule([[[0, 1, 3], [0, 1, 3], [2], [2]], [[4]] * 4], L, **DOMAIN)
    err = e.value
    assert (err.invariant, err.microbatch, err.ranks) == ("capacity", 0, [0, 1])
    assert "490 tokens on 2 ranks = 245 per rank > max_seqlen_per_rank 200" in str(err)
    assert isinstance(err, ValueError)


def test_a_schedule_object_is_validated_against_its_own_domain():
    s = schedule([300, 90, 60, 100, 700], **DOMAIN)
    validate_schedule(s)
    assert [v.invariant for v in check_schedule(s, min_cp_size=4)] == ["min-cp"] * sum(
        1 for mb in s.layout for b in mb if b.size < 4)


def test_raw_microbatches_need_the_domain():
    with pytest.raises(PlanInputError, match="need lengths, n_ranks and max_seqlen_per_rank"):
        check_schedule([[[0]]])


def test_non_power_of_two_domains_accept_only_existing_group_sizes():
    """For N=12 the dynamic groups are 1, 2, 4 (divisors of 12) and the whole domain."""
    lengths = [(0, 7000), (1, 100)]
    ok = [[[0]] * 12, [[1]] * 4 + [[2]] * 4 + [[3]] * 4]
    bad = [[[0]] * 8 + [[1]] * 4]
    assert not [v for v in check_schedule(ok, lengths + [(2, 1), (3, 1)], n_ranks=12, max_seqlen_per_rank=1024)]
    assert [v.invariant for v in check_schedule(bad, lengths, n_ranks=12, max_seqlen_per_rank=1024)] == ["block-size"]
