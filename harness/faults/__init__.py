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

from harness.faults.catalogue import FAULTS, LAYERS, Fault, UnknownFaultError, get, select
from harness.faults.checks import CHECKS, Alarm
from harness.faults.seam import SEAMS, SeamError, replaced

__all__ = ["FAULTS", "LAYERS", "CHECKS", "SEAMS", "Alarm", "Fault", "SeamError", "UnknownFaultError", "get",
           "replaced", "select"]
