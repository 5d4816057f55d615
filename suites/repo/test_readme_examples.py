"""The documentation's Python examples run as written, and the names it cites exist.

Every ```python block of README.md and docs/api.md (dedented when it sits in a list item) is executed
on its own, in a fresh namespace, from the repository root; the blocks are self-contained (the per-rank
sketch of the distributed API is a ```text block). Every ``harness.`` dotted name of the maintained
Markdown (``harness.plan.thd``, ``harness.faults.SEAMS``, ``harness.train.passes:rope_positions``) and
every name a ``from harness... import ...`` line of any code block imports must resolve in the code."""

from __future__ import annotations

import importlib
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DOCS = ("README.md", "docs/api.md")
"""The documents whose ```python blocks run."""
NAMED_DOCS = ("README.md", "NOTES.md", "reports/recorded/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
"""The documents whose ``harness.`` names must resolve."""

FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
DOTTED = re.compile(r"\bharness(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
FROM_IMPORT = re.compile(r"^\s*from (harness(?:\.\w+)*) import ([\w, ]+?)\s*(?:#.*)?$", re.M)


def _blocks(doc: str, lang: str | None = None) -> list[str]:
    text = (ROOT / doc).read_text()
    return [textwrap.dedent(body) for _, kind, body in FENCE.findall(text) if lang is None or kind == lang]


BLOCKS = [(doc, i, body) for doc in EXAMPLE_DOCS for i, body in enumerate(_blocks(doc, "python"))]


def test_the_docs_have_python_examples():
    per_doc = {doc: sum(d == doc for d, _, _ in BLOCKS) for doc in EXAMPLE_DOCS}
    assert per_doc["README.md"] >= 2, per_doc
    assert per_doc["docs/api.md"] >= 5, per_doc


@pytest.mark.parametrize(("doc", "index", "body"), BLOCKS, ids=[f"{d}:{i + 1}" for d, i, _ in BLOCKS])
def test_doc_python_block_runs(doc, index, body, monkeypatch):
    pytest.importorskip("hypothesis")
    monkeypatch.chdir(ROOT)
    code = compile(body, f"{doc} python block {index + 1}", "exec")
    exec(code, {"__name__": f"doc_block_{index + 1}"})


def resolve(name: str) -> object:
    """The object a dotted ``harness.`` name (``module.attr...`` or ``module:attr``) stands for; raises
    ``LookupError`` saying what is missing."""
    dotted, _, colon_attr = name.partition(":")
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name) and e.name.startswith("harness"):
                continue  # not a module: the rest are attributes of a shorter prefix
            raise
        break
    else:
        raise LookupError(f"{name}: no such module")
    for attr in parts[i:] + ([colon_attr] if colon_attr else []):
        if not hasattr(obj, attr):
            raise LookupError(f"{name}: {getattr(obj, '__name__', obj)!s} has no attribute {attr!r}")
        obj = getattr(obj, attr)
    return obj


def cited_names(doc: str) -> set[str]:
    text = (ROOT / doc).read_text()
    names = {m.group(0) for m in DOTTED.finditer(text)}
    for body in _blocks(doc):
        for module, imported in FROM_IMPORT.findall(body):
            names |= {f"{module}:{n.strip()}" for n in imported.split(",") if n.strip()}
    return names


def test_resolve_refuses_what_does_not_exist():
    assert resolve("harness.plan.thd:pack") is not None
    for bad in ("harness.plan.no_such_module", "harness.plan.thd.no_such_name", "harness.dist.groups"):
        with pytest.raises(LookupError):
            resolve(bad)


@pytest.mark.parametrize("doc", NAMED_DOCS)
def test_every_harness_name_in_the_docs_exists(doc):
    names = cited_names(doc)
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except LookupError as e:
            missing.append(str(e))
    assert not missing, f"{doc} cites names the code does not have:\n" + "\n".join(missing)


def test_the_api_page_cites_the_distributed_api():
    """docs/api.md's per-rank sketch imports what it calls (so the names test covers the text block)."""
    names = cited_names("docs/api.md")
    for name in ("harness.parallel.groups:DynamicGroups", "harness.parallel.reroute:reroute",
                 "harness.parallel.cp_attention:cp_attention", "harness.jobs.launch.run_on_ranks"):
        assert name in names, name
