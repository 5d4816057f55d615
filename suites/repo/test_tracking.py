"""wandb sink: one offline run per layout, grouped by case id (skipped without the tracking extra)."""

from __future__ import annotations

import pytest

from harness.report.tracking import log_runs


def test_offline_runs_per_layout(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    rows = {layout: [{"step": s, "loss": 5.0 - s, "grad_norm": 1.0, "tokens_per_s": 100.0} for s in range(3)]
            for layout in ("bshd", "dcp")}
    out = log_runs("case__x", rows, {"model": "tiny-gpt"}, tmp_path)
    assert out["wandb"] == "offline" and out["runs"] == 2
    runs = sorted(p.name for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-"))
    assert len(runs) == 2
