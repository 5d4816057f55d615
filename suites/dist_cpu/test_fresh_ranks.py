"""Training on fresh rank processes, each with its own string hash seed, as GPU jobs run.

The CPU suites fork their ranks from one zygote (``harness.jobs.zygote``), which gives every rank of a job the same
hash seed: a schedule, a group or an order that came from iterating a set of strings would agree on every forked rank
and differ between fresh ones (a GPU run's ranks, ``DCP_HARNESS_ZYGOTE=0``), where it hangs a collective or trains
each rank on another batch. This job runs with the zygote off and no ``PYTHONHASHSEED``, so each rank draws its own.
"""

from __future__ import annotations

from harness.apps import converge
from harness.jobs import zygote
from harness.train.trainer import TrainConfig


def test_dynamic_cp_on_fresh_ranks_with_their_own_hash_seeds_trains_as_on_forked_ranks(tmp_path, monkeypatch):
    cfg = TrainConfig(steps=2, layouts=("dcp",), max_seqlen_per_rank=256)  # dcp: where groups and schedules form
    # one reference for both runs (it runs on one rank: no hash seed to differ)
    kw = {"world": 4, "golden": "off", "report": False, "progress": lambda s: None, "stall_s": 120, "references": {}}
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    forked = converge.run(cfg, out_root=tmp_path / "forked", **kw)
    monkeypatch.setenv(zygote.ENV, "0")
    fresh = converge.run(cfg, out_root=tmp_path / "fresh", **kw)
    assert fresh.verdict == forked.verdict == "PASS", [c["target"] for c in fresh.checks if not c["pass"]]
    assert fresh.config["dcp_exercise"] == forked.config["dcp_exercise"]  # dynamic CP formed its groups alike
    for layout in cfg.layouts:  # the same schedules and batches on every rank: the same numbers, bit for bit
        assert [r["loss"] for r in fresh.rows[layout]] == [r["loss"] for r in forked.rows[layout]], layout
        assert [r["grad_norm"] for r in fresh.rows[layout]] == [r["grad_norm"] for r in forked.rows[layout]], layout
