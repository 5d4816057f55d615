"""Bad input gets a typed ``ValueError`` subclass naming the value and the fix, within a second,
from every algorithm."""

from __future__ import annotations

import time

import numpy as np
import pytest

from harness.plan import (
    ALGORITHMS,
    DuplicateGidError,
    InvalidLengthError,
    NotPowerOfTwoError,
    PlanInputError,
    SequenceTooLongError,
    UnknownAlgorithmError,
    normalize_lengths,
    schedule,
)

OK = dict(n_ranks=8, max_seqlen_per_rank=1024)

BAD = [
    ([100, 0, 5], OK, InvalidLengthError, r"sequence 1 has length 0; lengths must be >= 1"),
    ([100, -3], OK, InvalidLengthError, r"sequence 1 has length -3"),
    ([100, 2.5], OK, InvalidLengthError, r"lengths\[1\] must be an int, got float 2.5"),
    ([100, 3.0], OK, InvalidLengthError, r"convert it with int\(\)"),
    ([True], OK, InvalidLengthError, r"must be an int, got bool"),
    ([(0, 100), (0, 200)], OK, DuplicateGidError, r"gid 0 appears twice .*unique global id"),
    ([(0, 100, 1)], OK, InvalidLengthError, r"is not a \(gid, L\) pair"),
    ([(-1, 100)], OK, InvalidLengthError, r"gid -1"),
    ("1234", OK, InvalidLengthError, r"sequence of ints"),
    ([9000], OK, SequenceTooLongError, r"9000 tokens .*16 ranks .*only 8.*>= 1125"),
    ([100], dict(n_ranks=6, max_seqlen_per_rank=1024), NotPowerOfTwoError, r"n_ranks=6 .*use 4 or 8"),
    ([100], dict(n_ranks=0, max_seqlen_per_rank=1024), PlanInputError, r"n_ranks must be a positive int, got 0"),
    ([100], dict(n_ranks=8, max_seqlen_per_rank=0), PlanInputError, r"max_seqlen_per_rank must be a positive int"),
    ([100], dict(OK, min_cp_size=3), NotPowerOfTwoError, r"min_cp_size=3"),
    ([100], dict(OK, min_cp_size=16), PlanInputError, r"min_cp_size=16 exceeds n_ranks=8"),
    ([100], dict(OK, vpp_group=0), PlanInputError, r"vpp_group must be a positive int"),
]


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("lengths, kw, error, match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input(algorithm, lengths, kw, error, match):
    t = time.perf_counter()
    with pytest.raises(error, match=match) as e:
        schedule(lengths, algorithm=algorithm, **kw)
    assert time.perf_counter() - t < 1.0
    assert isinstance(e.value, ValueError)


def test_unknown_algorithm_lists_the_choices():
    with pytest.raises(UnknownAlgorithmError, match="'greedy'.*balanced, dp-balanced, megatron-dev, megatron-pr2000"):
        schedule([100], algorithm="greedy", **OK)


def test_numpy_inputs_become_python_ints():
    pairs = normalize_lengths(np.array([5, 9, 3], dtype=np.int32))
    assert pairs == ((0, 5), (1, 9), (2, 3)) and all(type(x) is int for p in pairs for x in p)
    assert normalize_lengths(np.array([[7, 5], [3, 9]])) == ((7, 5), (3, 9))
    assert normalize_lengths([(np.int64(4), np.int16(8))]) == ((4, 8),)


def test_empty_batch_is_an_empty_schedule():
    for algorithm in ALGORITHMS:
        s = schedule([], algorithm=algorithm, **OK)
        assert s.microbatches == [] and s.num_microbatches == 0
