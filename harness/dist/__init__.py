"""torch.distributed layer: launching worlds, dynamic DP x CP groups, rerouting, CP attention.

The only package that talks between processes (``harness.runtime`` is single-process torch,
``harness.plan`` has no torch at all).
"""
