"""The golden-trace tool: comparison rules, clear errors for missing/corrupted files, atomic writes."""

from __future__ import annotations

import json

import pytest

from harness import golden


def test_exact_and_approx_rules():
    assert golden.compare({"a": [1, 2.0]}, {"a": [1, 2.0]}, {"kind": "exact"}) == []
    diffs = golden.compare({"a": [1, 2.0]}, {"a": [1, 2.0000001]}, {"kind": "exact"})
    assert diffs == ["data.a[1]: 2.0000001 != golden 2.0"]
    assert golden.compare([2.0], [2.0000001], {"kind": "approx", "rtol": 1e-6}) == []
    assert golden.compare([1, 2], [1], {"kind": "exact"}) == ["data: length 1 != golden 2"]
    assert "keys differ" in golden.compare({"a": 1}, {"b": 1}, {"kind": "exact"})[0]


def test_missing_and_corrupted_files_say_how_to_fix(tmp_path):
    with pytest.raises(golden.GoldenError, match="missing; create it with: pytest x --update-golden"):
        golden.load(tmp_path / "nope.json", "pytest x --update-golden")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1, "case_id": ')
    with pytest.raises(golden.GoldenError, match="corrupted .*restore it from git or regenerate"):
        golden.load(bad)
    bad.write_text(json.dumps({"format": 1, "case_id": "x"}))
    with pytest.raises(golden.GoldenError, match="lacks 'config'"):
        golden.load(bad)


def test_write_is_atomic_and_records_producer(tmp_path):
    path = tmp_path / "suite" / "case.any.json"
    golden.write(path, suite="suite", case_id="case", hw="any", config={"k": 1}, data=[1, 2])
    doc = golden.load(path)
    assert doc["data"] == [1, 2] and doc["rule"] == {"kind": "exact"} and "versions" in doc["producer"]
    assert [p.name for p in path.parent.iterdir()] == ["case.any.json"]  # no temp file left


def test_producer_marks_a_tree_whose_code_differs_from_its_commit(tmp_path, monkeypatch):
    """A result written from edited code must not be attributed to the clean commit; rewritten
    goldens (what ``--update-golden`` does file after file) and untracked files do not count."""
    import subprocess

    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY"):  # set when run from a hook
        monkeypatch.delenv(var, raising=False)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "commit.gpgsign=false", "-c",
           "core.hooksPath=/dev/null"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "harness").mkdir()
    (tmp_path / "golden").mkdir()
    (tmp_path / "harness" / "f.py").write_text("x = 1\n")
    (tmp_path / "golden" / "g.json").write_text("{}\n")
    subprocess.run(git + ["add", "harness", "golden"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-qm", "c"], cwd=tmp_path, check=True)
    monkeypatch.setattr(golden, "SOURCE", tmp_path)
    clean = golden.producer()["git_rev"]
    assert clean and not clean.endswith("+dirty")
    (tmp_path / "untracked.txt").write_text("ignored\n")
    (tmp_path / "golden" / "g.json").write_text('{"regenerated": 1}\n')
    assert golden.producer()["git_rev"] == clean
    (tmp_path / "harness" / "f.py").write_text("x = 2\n")
    assert golden.producer()["git_rev"] == clean + "+dirty"


def test_a_changed_schedule_fails_the_golden_check(tmp_path, monkeypatch):
    """A committed golden with one slot edited: the plugin's check names the differing element."""
    from harness.pytest_plugin import Golden

    src = golden.GOLDEN_DIR / "plan" / "balanced__vector_a__n8__m2048.any.json"
    doc = json.loads(src.read_text())
    actual = doc["data"]
    edited = json.loads(src.read_text())
    edited["data"]["microbatches"][0][0] = [99]
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / src.name).write_text(json.dumps(edited))
    monkeypatch.setattr(golden, "GOLDEN_DIR", tmp_path)
    monkeypatch.setattr(golden.path_for, "__defaults__", ("any", tmp_path))
    with pytest.raises(pytest.fail.Exception, match=r"data.microbatches\[0\]\[0\]\[0\]: 0 != golden 99"):
        Golden(False, "t").check("plan", "balanced__vector_a__n8__m2048", doc["config"], actual)
    Golden(False, "t").check("plan", "balanced__vector_a__n8__m2048", doc["config"], edited["data"])
