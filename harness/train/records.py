"""Reading what a run's ranks recorded, numpy only: the process that judges a run's layouts (``harness.apps.converge``)
reads them without importing torch. ``load``: a rank's probes (``harness.train.probes``); ``first_difference``: where
two runs' MoE routes (``harness.train.routes``) first part."""

from __future__ import annotations

import numpy as np

BLOCK = 16
"""Positions of a sequence per route cell (``harness.train.routes``)."""
MAX_CELLS = 8
"""How many differing cells ``first_difference`` names (the count is always whole)."""


def first_difference(own: dict, ref: dict) -> dict | None:
    """Where the routes of ``own`` first differ from those of ``ref`` (each ``RouteLog.arrays()``): None if they
    agree at every step both ran, else ``{"step", "cells", "count", "worst_margin"}`` - the step (0-based), up to
    ``MAX_CELLS`` differing cells as ``[layer, sequence, first position, ref's margin, own margin]`` (largest first),
    their count, and over the cells the largest of each cell's smaller margin of the two runs (a cell counts as
    near a tie where either run had one there: rounding moves the margins of both alike)."""
    a, b = own["digests"], ref["digests"]
    n = min(len(a), len(b))
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f"route records of different shapes ({a.shape[1:]} and {b.shape[1:]} layers x cells):"
                         " the two runs trained different models or batches")
    for s in range(n):
        diff = np.argwhere(a[s] != b[s])
        if len(diff):
            worst = np.minimum(ref["margins"][s][tuple(diff.T)], own["margins"][s][tuple(diff.T)])
            order = np.argsort(-worst, kind="stable")
            blocks = int(own.get("blocks", 1))
            cells = [[int(diff[i][0]), int(diff[i][1]) // blocks, int(diff[i][1]) % blocks * BLOCK,
                      float(ref["margins"][s][tuple(diff[i])]), float(own["margins"][s][tuple(diff[i])])]
                     for i in order[:MAX_CELLS]]
            return {"step": s, "cells": cells, "count": len(diff), "worst_margin": float(worst.max())}
    return None


def load(small: dict) -> dict:
    """A rank's probes as ``Probes.result`` gives them, from what ``Probes.save`` returned and wrote."""
    if "file" not in small:  # returned whole (``Probes.portable``)
        return small
    out = {k: v for k, v in small.items() if k != "file"}
    out["grads"], out["clipped"] = {}, {}
    with np.load(small["file"]) as z:
        seqs = [dict(s) for s in small["sequences"]]
        for key in z.files:
            kind, _, name = key.partition(":")
            if kind in ("grads", "clipped"):
                out[kind][name] = z[key]
            else:
                seqs[int(kind[3:])][name] = z[key].tolist()
    out["sequences"] = seqs
    return out
