"""Promises of the repository: README opens with the two commands, CI runs exactly the second; docs/faults.md
lists every fault of the catalogue with its check and source; every relative link of the docs resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


def test_the_extras_pin_torch_and_the_upstream_stack():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cpu"] == ["torch==2.13.0"]
    assert "megatron-core==0.16.1; python_version < '3.12'" in extras["test"]  # the differential suites' upstream
    assert extras["gpu"] == ["transformer-engine[pytorch]==2.20.2", "megatron-core==0.19.2; python_version >= '3.12'"]


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


def _fault_rows() -> dict[str, list[str]]:
    """docs/faults.md's fault table: fault name -> its row's cells (fault, what, layer, source, caught by)."""
    rows = {}
    for line in (ROOT / "docs" / "faults.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 5:
            name = cells[0].strip("`")
            assert name not in rows, f"docs/faults.md lists {name} twice"
            rows[name] = cells
    return rows


def test_the_fault_page_lists_every_fault_with_its_check_and_source():
    from harness.faults import FAULTS

    rows = _fault_rows()
    missing = [f.name for f in FAULTS if f.name not in rows]
    assert not missing, f"docs/faults.md has no row for: {', '.join(missing)}"
    unknown = sorted(set(rows) - {f.name for f in FAULTS})
    assert not unknown, f"docs/faults.md lists faults the catalogue does not have: {', '.join(unknown)}"
    for f in FAULTS:
        _, _, layer, source, check = rows[f.name]
        assert (layer, check) == (f.layer, f.check), f"{f.name}: docs say {layer} / {check}, the catalogue {f.layer} / {f.check}"
        assert f"]({f.url})" in source, f"{f.name}: its source cell does not link {f.url}"


def test_the_fault_page_lists_every_check():
    from harness.faults import CHECKS

    text = (ROOT / "docs" / "faults.md").read_text()
    assert all(f"| `{c}` |" in text for c in CHECKS), [c for c in CHECKS if f"| `{c}` |" not in text]


LINKED_DOCS = ("README.md", "NOTES.md", "reports/recorded/README.md", "suites/README.md",
               *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings (lower case, punctuation dropped, spaces to
    hyphens, a repeated slug numbered)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", markdown).splitlines():
        m = re.match(r"#{1,6} +(.*?) *#* *$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_github_anchors_follow_githubs_rule():
    assert github_anchors("## `faults`: the fault catalogue, 2-core CPU\n## A\n## A") == {
        "faults-the-fault-catalogue-2-core-cpu", "a", "a-1"}


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_every_relative_link_resolves(doc):
    path = ROOT / doc
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest.read_text()):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc}:\n" + "\n".join(broken)
