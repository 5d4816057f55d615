"""Router replay end to end on gloo: PP=2, CP=2 and PP=2 x CP=2 (``harness.train.replay``)."""

from __future__ import annotations

import pytest

from harness.jobs.launch import run_on_ranks
from harness.train.replay import replay_check

pytestmark = pytest.mark.dist_cpu


@pytest.mark.parametrize("pp, cp", [(2, 1), (1, 2), (2, 2)], ids=["pp2", "cp2", "pp2_cp2"])
def test_replay_under_pp_and_cp(pp, cp, tmp_path):
    results = run_on_ranks(replay_check, world_size=pp * cp, tmp_path=tmp_path, args=({"pp": pp, "cp": cp},),
                           timeout_s=300)
    assert {(r["pp_rank"], r["cp_rank"]) for r in results} == {(p, c) for p in range(pp) for c in range(cp)}
    for r in results:
        assert r["tokens_checked"] > 0 and r["replay_mismatches"] == 0, r   # every token: the recorded experts
        assert r["free_mismatches"] > 0, r                                   # without replay: other experts
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
        assert r["grad_rel"] and max(r["grad_rel"].values()) <= 1e-5, r["grad_rel"]
    stages = {}
    for r in results:  # every parameter is owned by exactly one stage, and all of them are checked
        stages.setdefault(r["pp_rank"], set()).update(r["grad_rel"])
    names = [n for s in stages.values() for n in s]
    assert len(names) == len(set(names))
