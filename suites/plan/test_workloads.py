"""Length workloads: named distributions, the committed Wikipedia sample, length files."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from harness.data.workloads import WIKIPEDIA_SAMPLE, parse_spec, read_lengths, sample
from harness.plan import PlanInputError


def test_lognormal_is_megatrons_and_deterministic():
    spec = "lognormal:mean=1024,sigma=1.5,min=128,max=8192"
    a = sample(spec, 20000, seed=3)
    assert a == sample(spec, 20000, seed=3) and a != sample(spec, 20000, seed=4)
    assert min(a) == 128 and max(a) == 8192
    # mu = ln(mean) - sigma^2/2 makes the unclipped mean equal `mean`; clipping moves it a little
    assert 700 < np.mean(a) < 1100
    assert all(type(x) is int for x in a[:10])


def test_multiple_rounds_up():
    assert all(x % 16 == 0 for x in sample("uniform:min=1,max=100,multiple=16", 100, 0))


def test_wikipedia_sample_is_committed_and_real():
    pool = read_lengths(WIKIPEDIA_SAMPLE)
    assert len(pool) == 65536
    assert 300 <= float(np.median(pool)) <= 400  # the full data's median is 347
    assert max(sample("wikipedia:max=32768", 5000, 1)) == 32768


def test_file_spec(tmp_path):
    p = tmp_path / "lens.txt.gz"
    p.write_bytes(gzip.compress(b"# comment\n5\n9 # trailing\n\n3\n"))
    assert sample(f"file:{p}", None) == [5, 9, 3] and sample(f"file:{p}", 2) == [5, 9]


@pytest.mark.parametrize("spec, match", [
    ("zipf:a=2", "unknown length distribution 'zipf'"),
    ("lognormal:mean=1024", "needs sigma"),
    ("lognormal:mean=abc,sigma=1", "is not a number"),
    ("lognormal:mean=1,sigma=1,bogus=2", "bad parameter 'bogus=2'"),
    ("uniform:min=10,max=5", "1 <= min <= max"),
    ("file:/nonexistent/lens.txt", "does not exist"),
])
def test_bad_specs(spec, match):
    with pytest.raises(PlanInputError, match=match):
        sample(spec, 10, 0)


def test_bad_file_line(tmp_path):
    p = tmp_path / "lens.txt"
    p.write_text("5\nabc\n")
    with pytest.raises(PlanInputError, match=r"lens.txt:2: 'abc' is not an integer"):
        read_lengths(p)


def test_parse_spec():
    assert parse_spec("lognormal:mean=1024,sigma=1.5") == ("lognormal", {"mean": 1024.0, "sigma": 1.5})
