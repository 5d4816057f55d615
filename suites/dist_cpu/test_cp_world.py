"""Real gloo worlds of 2 and 4 processes: dynamic groups, rerouting, CP attention (fp32, forward and
backward) against single-process full attention. One world per size runs every check (start-up
costs seconds); the tests below judge its results."""

from __future__ import annotations

import pytest

from harness.jobs.launch import run_on_ranks
from harness.parallel.checks import all_checks

pytestmark = pytest.mark.dist_cpu


WORLDS = {"world2": (2, None), "world4": (4, None), "world4_dp1_cp2_tp2": (4, (1, 2, 2))}


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request, tmp_path_factory):
    size, parallel = WORLDS[request.param]
    cfg = {"dtype": "float32", "seed": size, "parallel": parallel}
    results = run_on_ranks(all_checks, world_size=size, tmp_path=tmp_path_factory.mktemp("world"), args=(cfg,),
                           timeout_s=120)
    tp = parallel[2] if parallel else 1
    return size // tp, results  # DP x CP positions


def test_every_dynamic_group_has_exactly_its_block(world):
    """With TP > 1 the groups of a TP coordinate are [t, t + tp, ...] (TP varies fastest)."""
    n, results = world
    for r in results:
        assert sorted(r["groups"]) == [s for s in (1, 2, 4) if s <= n]
        for size, g in r["groups"].items():
            assert g["ok"], (r["rank"], size, g)


def test_reroute_delivers_exactly_the_scheduled_gids(world):
    _, results = world
    for r in results:
        rr = r["reroute"]
        assert rr["gids"] == rr["expected_gids"] and rr["gids"]
        assert rr["content_ok"] and rr["sizes_ok"] and rr["slices_ok"]


def test_cp_attention_equals_full_attention(world):
    """Every K/V exchange (all-gather, ring, all-to-all), every block size, forward and backward."""
    n, results = world
    seen = set()
    for r in results:
        for a in r["attention"]:
            seen.add((a["size"], a["exchange"]))
            assert max(a["rel"].values()) <= 1e-5, (r["rank"], a)
            assert a["group_rank_sum"] == a["expected_rank_sum"], "the block's collective ran in another group"
            assert a["padding_grad_max"] == 0.0, (r["rank"], a)  # only padding attends padding; its do is 0
    assert seen == {(s, x) for s in (1, 2, 4) if s <= n for x in ("gather", "ring", "a2a")}
    assert sum(a["padding_tokens"] for r in results for a in r["attention"]) > 0  # the zero check saw padding
    layouts = {tuple(a["layout"]) for a in results[0]["attention"]}
    if n == 4:
        assert (2, 1, 1) in layouts and (1, 1, 2) in layouts  # mixed block sizes in one micro-batch
