"""The README's Python examples run as written: every ```python block (dedented when it sits in a
list item) is executed on its own, in a fresh namespace, from the repository root. The blocks are
self-contained; the per-rank sketch of the distributed API is a ```text block."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = [textwrap.dedent(body) for _, body in
          re.findall(r"^( *)```python\n(.*?)^\1```", (ROOT / "README.md").read_text(), re.S | re.M)]


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, monkeypatch):
    pytest.importorskip("hypothesis")
    monkeypatch.chdir(ROOT)
    code = compile(BLOCKS[index], f"README.md python block {index + 1}", "exec")
    exec(code, {"__name__": f"readme_block_{index + 1}"})
