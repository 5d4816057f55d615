"""Bad input gets a typed ``ValueError`` subclass naming the value and the fix, within a second,
from every algorithm; sizes past ``harness.plan.limits`` are refused before anything sized by them exists."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import numpy as np
import pytest

from harness.data.corpus import CorpusConfig, batch_lengths
from harness.data.workloads import make_wikipedia_sample, parse_spec, read_lengths, sample
from harness.plan import (
    ALGORITHMS,
    DuplicateGidError,
    InvalidLengthError,
    NotPowerOfTwoError,
    PlanInputError,
    SequenceTooLongError,
    SizeLimitError,
    UnknownAlgorithmError,
    check_schedule,
    normalize_lengths,
    schedule,
)
from harness.plan.limits import MAX_LENGTH, MAX_RANKS, MAX_SEQUENCES, MAX_WORK

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


# ------------------------------------------------------------------ sizes past the limits


def _in_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python child limited to 2 GiB of address space: an input that allocates with its size
    fails there (MemoryError or the timeout) instead of exhausting the machine running the tests."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_huge_n_ranks_is_refused_before_anything_is_allocated(algorithm):
    code = ("import time, tracemalloc; from harness.plan import schedule, SizeLimitError\n"
            "tracemalloc.start(); t = time.perf_counter()\n"
            "try:\n"
            f"    schedule([100, 200], n_ranks=1 << 40, max_seqlen_per_rank=512, algorithm={algorithm!r})\n"
            "except SizeLimitError as e:\n"
            "    print(repr(str(e)), time.perf_counter() - t, tracemalloc.get_traced_memory()[1])\n")
    try:
        r = _in_child(code)
    except subprocess.TimeoutExpired:
        pytest.fail("schedule(n_ranks=2**40) ran past 60 s instead of refusing the size")
    assert r.returncode == 0 and r.stdout, r.stderr[-2000:]
    message, took, peak = r.stdout.rsplit(" ", 2)
    assert "n_ranks=1099511627776 exceeds the limit 65536 (the schedulers keep state per rank" in message
    assert float(took) < 0.1 and int(peak) < 1 << 20  # refused before anything sized by n_ranks exists


@pytest.mark.parametrize("lengths, kw, match", [
    (lambda: [100], dict(n_ranks=MAX_RANKS * 2), r"n_ranks=131072 exceeds the limit 65536"),
    (lambda: [100] * (MAX_SEQUENCES + 1), dict(n_ranks=1), r"1048577 sequences exceed the limit 1048576"),
    (lambda: [100] * (MAX_WORK // 4096 + 1), dict(n_ranks=4096),
     r"32769 sequences x 4096 ranks = 134221824 exceeds the limit 134217728 .*use at most 32768 sequences on 4096"),
    (lambda: (L for L in [100] * (MAX_WORK // MAX_RANKS + 1)), dict(n_ranks=MAX_RANKS),
     r"2049 sequences x 65536 ranks"),  # no len(): counted as it is read
], ids=["ranks", "sequences", "sequences-x-ranks", "generator"])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_sizes_past_the_limits_are_typed_errors(algorithm, lengths, kw, match):
    lengths = lengths()
    t = time.perf_counter()
    with pytest.raises(SizeLimitError, match=match) as e:
        schedule(lengths, max_seqlen_per_rank=1024, algorithm=algorithm, **kw)
    assert time.perf_counter() - t < 1.0 and isinstance(e.value, PlanInputError)


@pytest.mark.parametrize("algorithm", ["balanced", "megatron-pr2000", "megatron-dev"])
def test_the_limits_themselves_are_accepted(algorithm):
    s = schedule([100, 5000, 70000, 3], n_ranks=MAX_RANKS, max_seqlen_per_rank=512, algorithm=algorithm)
    assert s.n_ranks == MAX_RANKS and not check_schedule(s)


@pytest.mark.parametrize("spec, match", [
    ("lognormal:mean=nan,sigma=1.5,min=128,max=8192", r"parameter mean=nan in .* must be a finite number"),
    ("lognormal:mean=1024,sigma=inf", r"parameter sigma=inf .* must be a finite number"),
    ("lognormal:mean=1024,sigma=-1", r"parameter sigma=-1 .* must be >= 0"),
    ("lognormal:mean=1024,sigma=20", r"parameter sigma=20 .* exceeds the limit 8"),
    ("lognormal:mean=0,sigma=1", r"parameter mean=0 .* must be > 0 and <= 16777216"),
    ("lognormal:mean=1e30,sigma=1", r"parameter mean=1e\+30 .* must be > 0 and <= 16777216"),
    ("lognormal:mean=1024,sigma=1,min=9000,max=8192", r"needs 1 <= min <= max, got min=9000, max=8192$"),
    ("uniform:min=10000", r"needs 1 <= min <= max, got min=10000, max=8192 \(the default\)"),
    ("uniform:min=-5,max=10", r"parameter min=-5 .* must be from 1 to 16777216"),
    ("const:value=4096.5", r"parameter value=4096.5 .* must be a whole number of tokens"),
    ("const:value=0", r"parameter value=0 .* must be from 1 to 16777216"),
    ("const:value=1e400", r"parameter value=inf .* must be a finite number"),
    ("wikipedia:max=0", r"parameter max=0 .* must be from 1 to 16777216"),
    ("wikipedia:max=99999999999", r"parameter max=99999999999 .* must be from 1 to 16777216"),
    ("uniform:min=1,max=100,multiple=0", r"parameter multiple=0 .* must be from 1"),
    ("lognormal:mean=1024,sigma=1,min=5,min=6", r"parameter min appears twice"),
])
def test_distribution_parameters_must_be_finite_and_in_range(spec, match):
    with pytest.raises(PlanInputError, match=match):
        parse_spec(spec)
    with pytest.raises(PlanInputError, match=match):
        sample(spec, 4, 0)


def test_lognormal_without_a_max_stays_within_the_length_limit():
    lengths = sample(f"lognormal:mean={MAX_LENGTH},sigma=4", 2000, 0)  # ~2% of the draws lie above the limit
    assert 1 <= min(lengths) and max(lengths) == MAX_LENGTH


@pytest.mark.parametrize("n, seed, error, match", [
    (MAX_SEQUENCES + 1, 0, SizeLimitError, r"1048577 sequences exceed the limit 1048576"),
    (-1, 0, PlanInputError, r"number of sequences must be an int >= 0, got -1"),
    (2.5, 0, PlanInputError, r"got 2.5"),
    (4, -1, PlanInputError, r"seed must be a non-negative int, got -1"),
])
def test_sample_sizes_and_seeds(n, seed, error, match):
    with pytest.raises(error, match=match):
        sample("uniform:min=1,max=10", n, seed)


def test_length_files_are_read_only_as_far_as_needed(tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("5\n6\n7\n8\nnot a length\n")
    assert sample(f"file:{f}", 2) == [5, 6]  # the first n: the bad line is never read
    with pytest.raises(SizeLimitError, match=r"holds more than 3 lengths, the limit \(why\); give at most 3"):
        read_lengths(f, 3, "why")


def test_the_wikipedia_fixture_samples_at_most_its_source(tmp_path):
    src = tmp_path / "src.txt"
    src.write_text("\n".join(map(str, range(1, 11))) + "\n")
    with pytest.raises(PlanInputError, match=r"cannot sample 11 lengths .* from src.txt, which holds 10; use --n 10"):
        make_wikipedia_sample(src, 11, 0, out=tmp_path / "out.txt.gz")
    with pytest.raises(PlanInputError, match=r"seed must be a non-negative int, got -1"):
        make_wikipedia_sample(src, 5, -1, out=tmp_path / "out.txt.gz")
    assert not (tmp_path / "out.txt.gz").exists()


@pytest.mark.parametrize("kw, error, match", [
    (dict(sequences_per_batch=0), PlanInputError, r"corpus sequences_per_batch must be an int >= 1, got 0"),
    (dict(sequences_per_batch=1 << 17), SizeLimitError, r"sequences_per_batch=131072 exceeds the limit 65536"),
    (dict(seed=-1), PlanInputError, r"corpus seed must be an int >= 0, got -1"),
    (dict(seed=2**32), SizeLimitError, r"corpus seed=4294967296 exceeds the limit 4294967295"),
    (dict(vocab=10**9), SizeLimitError, r"corpus vocab=1000000000 exceeds the limit 262144"),
    (dict(vocab=16, branching=17), SizeLimitError, r"corpus branching=17 exceeds the limit 16"),
    (dict(copy_fraction=float("nan")), PlanInputError, r"copy_fraction must be a number from 0 to 1, got nan"),
    (dict(lengths="lognormal:mean=nan,sigma=1"), PlanInputError, r"parameter mean=nan"),
])
def test_corpus_configs_no_corpus_can_be_drawn_from(kw, error, match):
    with pytest.raises(error, match=match):
        CorpusConfig(**kw)


def test_a_corpus_batch_past_the_token_limit_is_refused_before_its_tokens_are_drawn():
    c = CorpusConfig(sequences_per_batch=1 << 16, lengths="const:value=1024")
    with pytest.raises(SizeLimitError, match=r"global batch 3 has 67108864 tokens .* over the limit 16777216"):
        batch_lengths(c, 3)
