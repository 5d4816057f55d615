"""``suites.computed_once``: a result computed by the first worker that asks and read from the session's folder by the
others; nothing is written when the computation fails."""

from __future__ import annotations

import pytest

from suites import computed_once as co


def test_computed_once_then_read_by_another_worker(tmp_path_factory, monkeypatch):
    calls = []

    def compute():
        calls.append(1)
        return {"value": [1, 2, 3]}

    key = f"selftest-{id(calls)}"
    assert co.computed_once(tmp_path_factory, key, compute) == {"value": [1, 2, 3]}
    assert co.computed_once(tmp_path_factory, key, compute) == {"value": [1, 2, 3]} and len(calls) == 1
    monkeypatch.setattr(co, "_MEMO", {})  # another process: no memo, the same session folder
    assert co.computed_once(tmp_path_factory, key, compute) == {"value": [1, 2, 3]} and len(calls) == 1


def test_a_failed_computation_writes_nothing(tmp_path_factory):
    key = "selftest-fails"

    def boom():
        raise RuntimeError("no result")

    with pytest.raises(RuntimeError, match="no result"):
        co.computed_once(tmp_path_factory, key, boom)
    assert co.computed_once(tmp_path_factory, key, lambda: 7) == 7
