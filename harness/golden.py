"""Golden traces: files produced by the code, with their config, producer and comparison rule inside.

Layout: ``golden/<suite>/<case_id>.<hw>.json`` (``hw`` = ``any`` | ``cpu`` | ``h200`` ...). A file::

    {"format": 1, "case_id": ..., "suite": ..., "hw": ...,
     "config": {...},                       # what was run
     "producer": {"git_rev": ..., "versions": {...}, "command": ...},
     "rule": {"kind": "exact"} | {"kind": "approx", "rtol": ..., "atol": ...},
     "data": ...}                            # JSON values: numbers, strings, lists, dicts

Files are rewritten only by an explicit ``--update-golden`` run, atomically (an interrupted run
leaves the previous file intact).
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import __version__
from harness.finite import is_finite_number, nonfinite_message
from harness.io import atomic_write_json
from harness.paths import ROOT

GOLDEN_DIR = ROOT / "golden"
FORMAT = 1


class GoldenError(ValueError):
    """A golden file is missing, corrupted, or does not match."""


def path_for(suite: str, case_id: str, hw: str = "any", root: Path = GOLDEN_DIR) -> Path:
    return root / suite / f"{case_id}.{hw}.json"


CODE_PATHS = ("harness", "suites", "conftest.py", "pyproject.toml")
"""What ``producer`` checks for local changes: the code a result depends on."""

SOURCE = Path(__file__).resolve().parent.parent
"""The folder the running ``harness`` package was imported from (a checkout, or site-packages)."""


def source_revision() -> str:
    """The revision of the harness code that runs, never of the repository around the current folder:
    ``<HEAD, short>`` (``+dirty`` when tracked code differs from it - ``CODE_PATHS``, not the goldens and
    reports that runs write) when ``SOURCE`` is the top of a git checkout, else ``installed <version>``."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=SOURCE, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        rev = git("rev-parse", "--short", "HEAD") if top and Path(top).resolve() == SOURCE.resolve() else ""
        if rev and git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS):
            rev += "+dirty"
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return rev or f"installed {__version__}"


def producer(command: str = "") -> dict[str, Any]:
    """Who wrote a file: ``git_rev`` (``source_revision``), versions, the command."""
    versions = {"dcp-harness": __version__, "python": platform.python_version()}
    for mod in ("numpy", "torch"):
        if mod in sys.modules:
            versions[mod] = getattr(sys.modules[mod], "__version__", "?")
    return {"git_rev": source_revision(), "versions": versions, "command": command}


def write(path: Path, *, suite: str, case_id: str, hw: str, config: dict, data: Any,
          rule: dict | None = None, command: str = "") -> Path:
    doc = {"format": FORMAT, "case_id": case_id, "suite": suite, "hw": hw, "config": config,
           "producer": producer(command), "rule": rule or {"kind": "exact"}, "data": data}
    return atomic_write_json(path, doc)


def load(path: Path, update_hint: str = "pytest --update-golden") -> dict[str, Any]:
    if not path.is_file():
        raise GoldenError(f"golden file {path} is missing; create it with: {update_hint}")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GoldenError(f"golden file {path} is corrupted ({e}); restore it from git or "
                          f"regenerate it with: {update_hint}") from None
    for key in ("format", "case_id", "config", "rule", "data"):
        if not isinstance(doc, dict) or key not in doc:
            raise GoldenError(f"golden file {path} lacks '{key}'; regenerate it with: {update_hint}")
    if doc["format"] != FORMAT:
        raise GoldenError(f"golden file {path} has format {doc['format']}, expected {FORMAT}; "
                          f"regenerate it with: {update_hint}")
    return doc


RULE_KINDS = ("exact", "approx")
EXACT = {"kind": "exact"}


def checked_rule(rule: Any, policy: dict | None, path: Path | str, update_hint: str = "pytest --update-golden") -> dict:
    """The comparison rule a golden file states, if it is well-formed and at most as loose as the harness's
    ``policy`` for that quantity (None: exact). The tolerance is the harness's: a file may only tighten it.
    ``{"kind": "exact"}`` is the tightest rule; ``approx`` takes non-negative finite ``atol`` and ``rtol``."""
    policy = policy or EXACT
    fix = f"restore it from git or regenerate it with: {update_hint}"
    if not isinstance(rule, dict) or rule.get("kind") not in RULE_KINDS:
        kind = rule.get("kind") if isinstance(rule, dict) else rule
        raise GoldenError(f"golden file {path}: rule kind {kind!r} must be one of {list(RULE_KINDS)}; {fix}")
    allowed = {"kind"} | ({"atol", "rtol"} if rule["kind"] == "approx" else set())
    if set(rule) - allowed:
        raise GoldenError(f"golden file {path}: rule {rule['kind']!r} takes only {sorted(allowed)}, got "
                          f"{sorted(set(rule) - allowed)}; {fix}")
    for key in ("atol", "rtol"):
        if key in rule and not (is_finite_number(rule[key]) and rule[key] >= 0):
            raise GoldenError(f"golden file {path}: rule {key} {rule[key]!r} must be a finite number >= 0; {fix}")
    looser = [f"{key} {rule.get(key, 0.0):g} > {policy.get(key, 0.0):g}" for key in ("atol", "rtol")
              if rule.get(key, 0.0) > policy.get(key, 0.0)]
    if looser:
        raise GoldenError(f"golden file {path}: its rule is looser than the harness's tolerance for this quantity "
                          f"({', '.join(looser)}); a golden may only tighten it - {fix}")
    return rule


def checked_series(doc: dict, key: str, path: Path | str, update_hint: str, steps: int | None = None) -> list[float]:
    """``doc["data"][key]`` as a per-step series of finite numbers with at least ``steps`` entries."""
    fix = f"restore it from git or regenerate it with: {update_hint}"
    data = doc["data"]
    if not isinstance(data, dict) or key not in data:
        raise GoldenError(f"golden file {path} has no series {key!r}; {fix}")
    series = data[key]
    if not isinstance(series, list) or not series:
        raise GoldenError(f"golden file {path}: {key} must be a non-empty list of numbers; {fix}")
    bad = nonfinite_message(series, "", key)
    if bad:
        raise GoldenError(f"golden file {path}: {bad}: not a finite number; {fix}")
    if steps is not None and len(series) < steps:
        raise GoldenError(f"golden file {path} holds {len(series)} steps of {key}, this run trains {steps}: a golden "
                          f"serves runs of at most its length - run --steps {len(series)} or fewer, or {update_hint}")
    return [float(v) for v in series]


def compare(expected: Any, actual: Any, rule: dict, where: str = "data") -> list[str]:
    """Differences between ``expected`` and ``actual`` under ``rule`` (empty = match). A number that is
    not finite (NaN, inf) on either side is a difference, whatever the rule."""
    kind = rule.get("kind", "exact")
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = [f"{where}: keys differ: {sorted(set(expected) ^ set(actual))}"] if set(expected) != set(actual) else []
        for k in expected.keys() & actual.keys():
            out += compare(expected[k], actual[k], rule, f"{where}.{k}")
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: length {len(actual)} != golden {len(expected)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in compare(e, a, rule, f"{where}[{i}]")]
    numbers = (int, float)
    for side, v in (("", actual), ("golden ", expected)):
        if isinstance(v, float) and not math.isfinite(v):
            return [f"{where}: {side}value {v!r} is not a finite number"]
    if kind == "approx" and isinstance(expected, numbers) and isinstance(actual, numbers) \
            and not isinstance(expected, bool):
        ok = math.isclose(actual, expected, rel_tol=rule.get("rtol", 0.0), abs_tol=rule.get("atol", 0.0))
        return [] if ok else [f"{where}: {actual!r} != golden {expected!r} (rtol={rule.get('rtol')}, atol={rule.get('atol')})"]
    return [] if expected == actual else [f"{where}: {actual!r} != golden {expected!r}"]
