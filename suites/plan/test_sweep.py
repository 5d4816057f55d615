"""Nightly: a large random sweep at production sizes (up to 256 ranks and 2048 sequences per global
batch, heavy tails, min_cp, VPP), beyond what the hypothesis strategies draw."""

from __future__ import annotations

import math
import random

import pytest

from harness.plan import (
    ALGORITHMS,
    BatchTooSmallError,
    CostModel,
    check_schedule,
    gpt_benchmark_cost,
    schedule,
    simulate,
)

pytestmark = pytest.mark.nightly


@pytest.mark.parametrize("seed", range(8))
def test_large_random_batches_are_valid(seed):
    rng = random.Random(seed)
    costs = [CostModel.megatron(), gpt_benchmark_cost()]
    for _ in range(40):
        n = 1 << rng.randint(0, 8)
        mslpr = rng.choice([1024, 2048, 4096, 16384])
        num = rng.choice([n, 4 * n, 8 * n, rng.randint(1, 2048)])
        sigma = rng.choice([0.5, 1.2, 1.5, 2.5])
        lengths = [min(n * mslpr, max(1, int(rng.lognormvariate(math.log(mslpr * rng.choice([0.2, 0.5, 1.0])), sigma))))
                   for _ in range(num)]
        kw = dict(n_ranks=n, max_seqlen_per_rank=mslpr, min_cp_size=1 << rng.randint(0, min(2, n.bit_length() - 1)),
                  vpp_group=rng.choice([None, 2, 4]))
        cost = rng.choice(costs)
        for algorithm in ALGORITHMS:
            try:
                s = schedule(lengths, algorithm=algorithm, cost=cost, **kw)
            except BatchTooSmallError:
                assert algorithm != "balanced" or num < 4 * n, (algorithm, kw, num)
                continue
            assert not check_schedule(s), (algorithm, kw)
            if algorithm == "balanced":
                sim = simulate(s)
                assert max(sim.waiting) <= 1e-9 * sim.step_time
