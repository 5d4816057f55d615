"""``harness.paths``: goldens and fixtures are found from a source checkout and, for a non-editable
install (the package copied into site-packages without the data), from the checkout the user runs in."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _root_seen(pythonpath: Path, cwd: Path) -> str:
    code = "from harness.paths import ROOT; from harness.data.workloads import WIKIPEDIA_SAMPLE; print(ROOT); print(WIKIPEDIA_SAMPLE.is_file())"
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env={"PYTHONPATH": str(pythonpath), "PATH": ""},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_source_checkout_is_the_root():
    assert _root_seen(ROOT, ROOT).split() == [str(ROOT), "True"]


def test_non_editable_install_finds_the_checkout_it_runs_in(tmp_path):
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "harness", site / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    assert _root_seen(site, ROOT / "suites").split() == [str(ROOT), "True"]  # a sub-directory works too
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    # outside any checkout: the package's parent, so a missing file is named where it was looked for
    assert _root_seen(site, elsewhere).split() == [str(site), "False"]
