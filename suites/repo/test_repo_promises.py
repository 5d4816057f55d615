"""Promises of the repository: README opens with the two commands, CI runs exactly the second."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks[:2]]


def test_readme_opens_with_install_and_run_then_install_and_test():
    main, tests = _readme_commands()
    assert main.startswith("pip install -e") and main.endswith("dcp-harness run")
    assert tests.startswith("pip install -e") and tests.endswith("pytest -n auto")
    assert "cpu" in main and "cpu" in tests  # the CPU torch pin


def test_ci_runs_exactly_the_readme_test_command():
    _, tests = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines()
    assert '"$rc" -eq 5' in ci


def test_cpu_extra_pins_torch():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'cpu = ["torch==2.13.0"]' in text and '"megatron-core==0.16.1"' in text


def test_the_code_passes_the_project_lint_rules():
    """``ruff check`` with ``[tool.ruff]`` of pyproject.toml (the test extra pins ruff)."""
    import shutil
    import subprocess
    import sys

    import pytest

    exe = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")
    if not Path(exe).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    r = subprocess.run([str(exe), "check", "--no-cache", "harness", "suites", "conftest.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
