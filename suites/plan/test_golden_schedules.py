"""Golden traces of schedules: any change of an algorithm's output on these inputs is visible in
review (``pytest --update-golden`` rewrites them; the file records config, producer and rule)."""

from __future__ import annotations

import pytest

from harness.data.workloads import sample
from harness.plan import ALGORITHMS, gpt_benchmark_cost, quality, schedule

CASES = {
    "vector_a__n8__m2048": dict(lengths=[8192, 4096, 3000, 2048, 1024, 1024, 512, 512, 256], n_ranks=8,
                                max_seqlen_per_rank=2048),
    "lognormal1024__n8__s64__m2048": dict(spec="lognormal:mean=1024,sigma=1.5,min=128,max=8192", num=64,
                                          n_ranks=8, max_seqlen_per_rank=2048),
    "wikipedia32k__n32__s256__m4096__vpp2": dict(spec="wikipedia:max=32768", num=256, n_ranks=32,
                                                 max_seqlen_per_rank=4096, vpp_group=2),
    "lognormal4096__n16__s128__m16384__mincp2": dict(spec="lognormal:mean=4096,sigma=1.5,min=256,max=131072",
                                                     num=128, n_ranks=16, max_seqlen_per_rank=16384, min_cp_size=2),
}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("case_id", list(CASES))
def test_schedule_matches_golden(golden, case_id, algorithm):
    cfg = dict(CASES[case_id])
    lengths = cfg.pop("lengths", None) or sample(cfg.pop("spec"), cfg.pop("num"), seed=0)
    gpt = gpt_benchmark_cost()
    s = schedule(lengths, algorithm=algorithm, cost=gpt, **cfg)
    config = {**CASES[case_id], "algorithm": algorithm, "seed": 0, "cost": gpt.name}
    data = {"microbatches": s.microbatches, "quality": round(quality(s, gpt), 6)}
    golden.check("plan", f"{algorithm}__{case_id}", config, data)
