"""Router replay end to end on gloo: PP=2, CP=2, PP=2 (interleaved, 2 virtual chunks) x CP=2, and CP or PP with 2 TP
ranks, with and without sequence parallelism (``harness.train.replay``)."""

from __future__ import annotations

import pytest

from harness.jobs.launch import run_on_ranks
from harness.train.replay import replay_check

pytestmark = pytest.mark.dist_cpu


@pytest.mark.parametrize("pp, vpp, cp, tp, sp, ep", [(2, 1, 1, 1, None, False), (1, 1, 2, 1, None, False),
                                                     (2, 2, 2, 1, None, False), (1, 1, 2, 2, True, True),
                                                     (2, 1, 1, 2, True, False), (1, 1, 2, 2, False, False)],
                         ids=["pp2", "cp2", "pp2_vpp2_cp2", "cp2_tp2_sp_ep", "pp2_tp2_sp", "cp2_tp2"])
def test_replay_under_pp_cp_and_tp(pp, vpp, cp, tp, sp, ep, tmp_path):
    """With TP (blocks, experts and vocabulary split) and sequence parallelism each TP rank's router routes, and
    replays, its share of the CP rank's rows (``harness.plan.replay.sp_rows``); without SP every TP rank replays every
    row; with expert parallelism too, the replayed experts' owners in each TP coordinate's CP group run them. Under the
    interleaved pipeline (2 virtual chunks a stage: stage 0 builds layers 0 and 2, stage 1 layers 1 and 3) the store is
    keyed by global layer, so the chunks' interleaved visits do not matter. Every token's experts are the rollout's and
    the loss and whole gradients (an expert's on its owner) equal the unsplit reference."""
    results = run_on_ranks(replay_check, world_size=pp * cp * tp, tmp_path=tmp_path,
                           args=({"pp": pp, "vpp": vpp, "cp": cp, "tp": tp, "sp": sp, "ep": ep},), timeout_s=300)
    assert {(r["pp_rank"], r["cp_rank"], r["tp_rank"]) for r in results} == \
        {(p, c, t) for p in range(pp) for c in range(cp) for t in range(tp)}
    assert all(r["sp"] == (tp > 1 and sp is not False) for r in results)
    for r in results:
        assert r["tokens_checked"] > 0 and r["replay_mismatches"] == 0, r   # every token: the recorded experts
        assert r["free_mismatches"] > 0, r                                   # without replay: other experts
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
        assert r["grad_rel"] and all(v <= 1e-5 for v in r["grad_rel"].values()), r["grad_rel"]  # NaN fails
    stages = {}
    for r in results:  # every parameter is owned by exactly one stage, and all of them are checked
        stages.setdefault(r["pp_rank"], set()).update(r["grad_rel"])
    names = [n for s in stages.values() for n in s]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("cfg, world, match", [
    ({"pp": 1, "cp": 2, "tp": 1, "sp": True}, 2, r"sp=True splits the token rows over the TP ranks and tp=1"),
    ({"pp": 1, "cp": 2, "tp": 2, "sp": False, "ep": True}, 4, r"expert parallelism with tensor parallelism needs "
                                                              r"sequence parallelism"),
    ({"pp": 1, "cp": 2, "tp": 2}, 2, r"pp=1 x cp=2 x tp=2 needs 4 ranks, the world has 2"),
    ({"pp": 1, "vpp": 2, "cp": 2}, 2, r"vpp=2: virtual pipeline chunks need an int >= 1, and pp >= 2 when > 1"),
])
def test_replay_configurations_it_cannot_run_are_refused_before_any_collective(cfg, world, match):
    with pytest.raises(ValueError, match=match):
        replay_check(0, world, cfg)
