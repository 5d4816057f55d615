"""The benchmark grid as a correctness test: on every (distribution, ranks, sequences) configuration
of ``dcp-harness bench schedule``, every algorithm is valid and ``balanced`` has a strictly better
quality than both Megatron algorithms (quality is exact arithmetic, not timing; latency targets are
checked by the benchmark itself)."""

from __future__ import annotations

import pytest

from harness.bench.schedule import CONFIGS, DISTRIBUTIONS
from harness.plan import ALGORITHMS, check_schedule, gpt_benchmark_cost, quality, schedule
from harness.workloads import sample

GPT = gpt_benchmark_cost()


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
@pytest.mark.parametrize("n_ranks, num", CONFIGS, ids=[f"{n}x{k}" for n, k in CONFIGS])
def test_balanced_beats_megatron_on_the_grid(dist, n_ranks, num):
    spec, mslpr = DISTRIBUTIONS[dist]
    lengths = sample(spec, num, seed=0)
    q = {}
    for algorithm in ALGORITHMS:
        s = schedule(lengths, n_ranks=n_ranks, max_seqlen_per_rank=mslpr, algorithm=algorithm, cost=GPT)
        assert not check_schedule(s)
        q[algorithm] = quality(s, GPT)
    assert q["balanced"] < q["megatron-dev"] and q["balanced"] < q["megatron-pr2000"], q
    if dist == "lognormal-1024" and num >= 32 * n_ranks:
        assert q["balanced"] <= 1.05, q
