"""``harness.paths``: goldens and fixtures are found from a source checkout; for a non-editable install, from the
checkout the user runs in, else from the data files the wheel installed under ``{prefix}/share/dcp-harness``; reports
go to the checkout's ``reports/`` or the current directory's, never into an installed package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _root_seen(pythonpath: Path, cwd: Path) -> str:
    code = ("from harness.paths import ROOT, REPORTS; from harness.data.workloads import WIKIPEDIA_SAMPLE; "
            "print(ROOT); print(WIKIPEDIA_SAMPLE.is_file()); print(REPORTS)")
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env={"PYTHONPATH": str(pythonpath), "PATH": ""},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_source_checkout_is_the_root():
    assert _root_seen(ROOT, ROOT).split() == [str(ROOT), "True", str(ROOT / "reports")]


def test_non_editable_install_finds_the_checkout_it_runs_in(tmp_path):
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "harness", site / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    assert _root_seen(site, ROOT / "suites").split() == [str(ROOT), "True", str(ROOT / "reports")]  # a sub-folder too
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    # outside any checkout, no data installed: the package's parent, so a missing file is named where it was looked
    # for; reports go to the current folder, not into site-packages
    assert _root_seen(site, elsewhere).split() == [str(site), "False", str(elsewhere / "reports")]


def test_an_installed_wheel_reads_the_data_files_it_installed_outside_any_checkout(tmp_path):
    """The layout ``pip install`` gives a wheel (``{prefix}/lib/pythonX.Y/site-packages/harness`` and the data files
    under ``{prefix}/share/dcp-harness``): the goldens and fixtures are read there, reports go to the current folder."""
    prefix = tmp_path / "prefix"
    site = prefix / "lib" / "python3.x" / "site-packages"
    shutil.copytree(ROOT / "harness", site / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    share = prefix / "share" / "dcp-harness"
    for folder in ("golden", "fixtures"):
        shutil.copytree(ROOT / folder, share / folder)
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    assert _root_seen(site, elsewhere).split() == [str(share), "True", str(elsewhere / "reports")]


def test_the_wheel_carries_every_golden_and_fixture_folder():
    """``pyproject.toml``'s data files name one folder each: a new folder of goldens or fixtures must be added there,
    or an installed wheel would miss it."""
    import tomllib

    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    folders = {p.parent.relative_to(ROOT).as_posix() for d in ("golden", "fixtures") for p in (ROOT / d).rglob("*")
               if p.is_file()}
    assert {f"share/dcp-harness/{f}" for f in folders} == set(files)
    for target, patterns in files.items():
        local = target.removeprefix("share/dcp-harness/")
        assert all(p.startswith(local + "/") for p in patterns), (target, patterns)
        covered = {q for p in patterns for q in ROOT.glob(p)}
        assert covered == {p for p in (ROOT / local).iterdir() if p.is_file()}, target
