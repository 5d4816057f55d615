"""Where the project's data lives: ``golden/``, ``fixtures/`` and ``reports/``.

``checkout()``: the source checkout the package was imported from (editable install or ``PYTHONPATH``), or for an
installed package the first of the current directory and its parents that is a dcp-harness checkout (holds
``golden/`` and ``harness/``); None outside any.

``data_root()`` (``ROOT``): where ``golden/`` and ``fixtures/`` are read - the checkout when there is one, else the
copy a wheel installs as data files (``{prefix}/share/dcp-harness``: ``pip install dcp-harness`` or ``pip install
git+...`` without a checkout), else the package's parent, so that errors name the file that is missing.

``REPORTS``: where commands write by default - the checkout's ``reports/``, else ``reports/`` of the current
directory (never into an installed package or its prefix).
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

SHARE = ("share", "dcp-harness")
"""Where a wheel's data files put ``golden/`` and ``fixtures/`` under its install prefix (``pyproject.toml``)."""


def _is_checkout(d: Path) -> bool:
    return (d / "golden").is_dir() and (d / "harness").is_dir()


def _package_parent() -> Path:
    return Path(__file__).resolve().parent.parent


def checkout(cwd: Path | None = None) -> Path | None:
    """The dcp-harness source checkout in use (see the module doc), or None."""
    here = _package_parent()
    if _is_checkout(here):
        return here
    start = (cwd or Path.cwd()).resolve()
    return next((d for d in (start, *start.parents) if _is_checkout(d)), None)


def installed_data() -> Path | None:
    """The data files a wheel installed (``{prefix}/share/dcp-harness`` holding ``golden/``), or None. The prefix is
    the one the package sits in (``{prefix}/lib/pythonX.Y/site-packages``: a venv, ``--user`` or the system), else
    ``sys.prefix`` or the user base."""
    here = _package_parent()
    bases = [here.parents[2]] if len(here.parents) > 2 else []
    bases += [Path(sys.prefix), Path(site.getuserbase())]
    return next((b.joinpath(*SHARE) for b in bases if (b.joinpath(*SHARE) / "golden").is_dir()), None)


def data_root(cwd: Path | None = None) -> Path:
    """Where ``golden/`` and ``fixtures/`` are read (see the module doc)."""
    return checkout(cwd) or installed_data() or _package_parent()


def reports_root(cwd: Path | None = None) -> Path:
    """Where commands write their reports by default (see the module doc)."""
    return (checkout(cwd) or (cwd or Path.cwd()).resolve()) / "reports"


ROOT = data_root()
"""Where ``golden/`` and ``fixtures/`` are read."""
REPORTS = reports_root()
"""Where commands write their reports by default."""
