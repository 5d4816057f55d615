"""One fault of the catalogue (``harness.faults.catalogue``): a real bug, where it comes from, the seam it replaces
and the check that must catch it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from harness.faults.seam import replaced


@dataclass(frozen=True, kw_only=True)
class Fault:
    name: str
    """Id: the pytest id, the report key and the ``--only`` name."""
    title: str
    source: str
    """The upstream report it re-creates: project, PR or issue, and what went wrong."""
    url: str
    layer: str
    """What it breaks (``LAYERS``)."""
    seam: str
    """``module:function`` replaced for the length of the run (``harness.faults.seam.SEAMS``)."""
    make: Callable[[Callable], Callable] = field(repr=False)
    """``make(original) -> faulty function`` with the seam's signature."""
    check: str
    """The cheapest check that catches it (``harness.faults.checks.CHECKS``)."""
    expect: str
    """A regular expression the check's alarm message must match."""
    scenario: str = "train"
    """Which run exercises it (``SCENARIOS``; ``harness.faults.scenarios``)."""

    @contextmanager
    def applied(self) -> Iterator[Callable]:
        """The fault, active for the ``with`` block only."""
        with replaced(self.seam, self.make, label=self.name) as fn:
            yield fn
