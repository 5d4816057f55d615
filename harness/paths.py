"""Where the project's data lives: ``golden/``, ``fixtures/`` and ``reports/``.

``project_root()``: the source checkout the package was imported from (editable install or
``PYTHONPATH``); for a non-editable install (the package in site-packages, without the data), the
first of the current directory and its parents that is a dcp-harness checkout (holds ``golden/`` and
``harness/``); failing both, the package's parent, so that errors name the file that is missing.
"""

from __future__ import annotations

from pathlib import Path


def _is_checkout(d: Path) -> bool:
    return (d / "golden").is_dir() and (d / "harness").is_dir()


def project_root(cwd: Path | None = None) -> Path:
    here = Path(__file__).resolve().parent.parent
    if _is_checkout(here):
        return here
    start = (cwd or Path.cwd()).resolve()
    return next((d for d in (start, *start.parents) if _is_checkout(d)), here)


ROOT = project_root()
REPORTS = ROOT / "reports"
"""Where commands write their reports by default."""
