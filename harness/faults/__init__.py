"""The fault catalogue: named re-creations of real dynamic-CP, router-replay and step-wise bugs, applied
through documented seams for the length of a run; the suites must catch every one.

>>> from harness.faults import FAULTS, get
>>> get("stale-cp-group").check
'group-audit'
>>> len(FAULTS) >= 16
True

``dcp-harness faults`` runs them (``harness.faults.run.run_catalogue``); ``harness.faults.catalogue``
explains how to add one.
"""

import importlib

_SOURCES = {**dict.fromkeys(("FAULTS", "LAYERS", "Fault", "UnknownFaultError", "get", "select"), "catalogue"),
            **dict.fromkeys(("CHECKS", "Alarm"), "checks"),
            **dict.fromkeys(("SEAMS", "SeamError", "replaced"), "seam")}
"""Where each public name lives. They load on first use (PEP 562): the fault modules import torch, and a process
that reads only ``harness.faults.checks`` (a launching ``dcp-harness converge`` judging its ranks' results) need not
pay for it."""

__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module 'harness.faults' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"harness.faults.{_SOURCES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})
