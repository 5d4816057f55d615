"""Output files: atomic, with the mode the umask gives any file, and paths refused before a job runs."""

from __future__ import annotations

import os

import pytest

from harness.io import OutputPathError, atomic_write_text, writable


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
