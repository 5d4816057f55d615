"""bshd, THD packing and dynamic CP train the same model: same losses step for step (fp32, CPU), for
attention-only, MoE, multi-token prediction and hybrid SSM (Mamba-style) models."""

from __future__ import annotations

import pytest

from harness.apps import route_rule
from harness.jobs.launch import run_on_ranks
from harness.train.trainer import train

pytestmark = pytest.mark.dist_cpu


@pytest.fixture(scope="module", params=["tiny-gpt", "tiny-moe", "tiny-gpt@ring", "tiny-gpt-mtp",
                                                  "tiny-hybrid", "tiny-gpt#16"])
def runs(request, tmp_path_factory):
    """Each model with the all-gather K/V exchange, and tiny-gpt with the ring exchange (every CP
    block of every layout then passes K/V around its ring) and with every thd / dcp micro-batch padded to a
    multiple of 16 tokens per rank (``#16``: bench step's token bucket). tiny-moe runs bshd in micro-batches of 4
    padded sequences (as the nightly's GPU MoE cases do), the others one sequence per bshd micro-batch; tiny-moe with
    the routers' balance loss (each of those sequences balanced on its own, whatever the layout packs with it)."""
    name, _, bucket = request.param.partition("#")
    model, _, exchange = name.partition("@")
    cfg = {"model": model, "steps": 3, "max_seqlen_per_rank": 512, "cp_exchange": exchange or "gather",
           "corpus": {"sequences_per_batch": 16}, "micro_batch_size": 4 if model == "tiny-moe" else 1,
           "token_bucket": int(bucket or 0), **({"moe_aux_loss": 1e-2} if model == "tiny-moe" else {})}
    out = run_on_ranks(train, world_size=2, tmp_path=tmp_path_factory.mktemp("conv"), args=(cfg,), timeout_s=600)
    return request.param, out[0]


def test_all_layouts_agree_within_1e_5(runs):
    _, r = runs
    rows = r["layouts"]
    assert set(rows) == {"bshd", "thd", "dcp"}
    for step in range(3):
        ref = rows["bshd"][step]
        for layout in ("thd", "dcp"):
            row = rows[layout][step]
            assert abs(row["loss"] - ref["loss"]) <= 1e-5, (layout, step, row["loss"], ref["loss"])
            assert abs(row["aux_loss"] - ref["aux_loss"]) <= 1e-6
            assert ("mtp_loss" in row) == ("mtp_loss" in ref)
            if "mtp_loss" in ref:  # each MTP depth's loss, not only the total
                assert max(abs(a - b) for a, b in zip(row["mtp_loss"], ref["mtp_loss"], strict=True)) <= 1e-5
            assert row["tokens"] == ref["tokens"]


def test_padding_and_schedules_differ_as_designed(runs):
    param, r = runs
    model = param.partition("#")[0].partition("@")[0]
    rows = r["layouts"]
    if "#" in param:  # every rank's micro-batch a multiple of the bucket: so is their sum
        assert all(row["processed_tokens"] % 16 == 0 for layout in ("thd", "dcp") for row in rows[layout])
    assert r["static_cp"] == 2  # the 1024-token sequences need 2 ranks at 512 per rank
    for step in range(3):
        assert rows["bshd"][step]["padding_fraction"] > rows["thd"][step]["padding_fraction"]
        assert rows["bshd"][step]["cp_histogram"] == {"2": 16}
        assert rows["bshd"][step]["microbatches"] == (4 if model == "tiny-moe" else 16)
    assert all(rows[layout][0]["grad_norm"] > 0 for layout in rows)
    if model == "tiny-gpt-mtp":
        assert all(len(rows[layout][0]["mtp_loss"]) == 1 and rows[layout][0]["mtp_loss"][0] > 0 for layout in rows)
    if model == "tiny-moe":
        assert rows["bshd"][0]["aux_loss"] > 0  # router z-loss and balance loss over real tokens only
        # the routes every layout recorded, summed over the ranks, are the same whatever the layout did to the
        # tokens (CP 2 slices, padding, packing); no near-tie flips in these 3 steps
        assert [r["route_digest"] for r in rows["thd"]] == [r["route_digest"] for r in rows["bshd"]] == \
            [r["route_digest"] for r in rows["dcp"]]
        assert all(0 < r["route_margin"] < 1 for lay in rows.values() for r in lay)
        arrays = route_rule.load(r["routes"]["dcp"])  # no shared folder given: the records travel in the result
        assert arrays["digests"].shape[:2] == (3, 3) and arrays["digests"][:, 0].sum() == 0
        assert route_rule.judge("dcp vs bshd", arrays, route_rule.load(r["routes"]["bshd"]), "float32", 20) == \
            ((None, "MoE routing"), [])
    else:
        assert "routes" not in r and "route_digest" not in rows["bshd"][0]
    if model != "tiny-moe":
        assert rows["bshd"][0]["aux_loss"] == 0
