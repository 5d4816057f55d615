"""Output files: atomic, with the mode the umask gives any file, and paths refused before a job runs."""

from __future__ import annotations

import json
import math
import os

import pytest

from harness.io import OutputPathError, atomic_write_json, atomic_write_text, strict_json, writable


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_honour_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        p = atomic_write_text(tmp_path / "sub" / "r.json", "{}")
    finally:
        os.umask(old)
    assert p.read_text() == "{}" and p.stat().st_mode & 0o777 == mode
    assert [x.name for x in p.parent.iterdir()] == ["r.json"]  # no temporary file left


def test_writable_refuses_what_cannot_be_written(tmp_path):
    assert writable(tmp_path / "new" / "x.json") == tmp_path / "new" / "x.json"
    with pytest.raises(OutputPathError, match="is a directory"):
        writable(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputPathError, match="cannot create the folder of"):
        writable(tmp_path / "f" / "x.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "new"]  # the probe file is gone


def _strict(text: str):
    """Parse as a strict JSON parser does: Python's NaN / Infinity literals are refused."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_json_outputs_are_strict_json_with_nan_and_inf_as_null(tmp_path):
    """A diverged run's NaN loss and a check's inf margin: ``null`` in the file, which strict parsers read
    (``JSON.parse``, jq); nested dicts, lists and tuples alike, every finite number as it was."""
    obj = {"loss": math.nan, "margins": [math.inf, -math.inf, 1.5], "pair": (math.nan, 2), "n": 3, "ok": True,
           "deep": {"x": [{"y": math.nan}]}}
    path = atomic_write_json(tmp_path / "r.json", obj)
    got = _strict(path.read_text())
    assert got == {"loss": None, "margins": [None, None, 1.5], "pair": [None, 2], "n": 3, "ok": True,
                   "deep": {"x": [{"y": None}]}}
    assert _strict(strict_json({"a": math.nan})) == {"a": None}


def test_files_the_harness_exchanges_keep_nan_when_asked(tmp_path):
    """A job's result read back by its launcher keeps a NaN loss a NaN (the checks name it: ``step 7: loss is
    nan``): ``strict=False``."""
    path = atomic_write_json(tmp_path / "job.json", {"loss": [1.0, math.nan]}, strict=False)
    loss = json.loads(path.read_text())["loss"]
    assert loss[0] == 1.0 and math.isnan(loss[1])
    with pytest.raises(ValueError, match="NaN is not JSON"):
        _strict(path.read_text())
