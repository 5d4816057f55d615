"""One-dimensional bin packing of token counts, shared by ``balanced`` and ``lower_bound``.

``min_bins(sizes, cap)`` groups item indices into few bins of ``cap``: first fit decreasing, then,
when that is above ``simple_bound``, a depth-first branch and bound for fewer bins, stopped after
``node_limit`` nodes. It says whether its count is *proven* least (the simple bound was met or the
search finished), so that a lower bound may use the count only then.

>>> min_bins([6, 5, 4, 3, 2], 10)
Packing(bins=[[0, 2], [1, 3, 4]], proven=True)
>>> simple_bound([6, 6, 6], 10)
3
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.plan.errors import PlanInputError


@dataclass(frozen=True)
class Packing:
    bins: list[list[int]]
    """Indices into ``sizes``, per bin, in the order they were placed."""
    proven: bool
    """True when no packing uses fewer bins."""


def simple_bound(sizes: list[int], cap: int) -> int:
    """Bins any packing needs: total / cap rounded up, and one bin per item over half of ``cap``
    (two such items never share a bin)."""
    return max(-(-sum(sizes) // cap), sum(1 for x in sizes if 2 * x > cap)) if sizes else 0


def min_bins(sizes: list[int], cap: int, node_limit: int = 2_000) -> Packing:
    """Few bins of ``cap`` for ``sizes`` (each in ``1..cap``); deterministic: the same input explores
    the same nodes and returns the same bins."""
    bad = [x for x in sizes if not 1 <= x <= cap]
    if cap < 1 or bad:
        raise PlanInputError(f"bin packing needs items in 1..cap={cap}, got {bad[:5]}: pack only items "
                             f"that fit one bin (a positive cap, each item at least 1 and at most the cap)")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        k = next((k for k, r in enumerate(room) if sizes[i] <= r), None)
        if k is None:
            bins.append([])
            room.append(cap)
            k = len(bins) - 1
        bins[k].append(i)
        room[k] -= sizes[i]
    bound = simple_bound(sizes, cap)
    if len(bins) <= bound:
        return Packing(bins, True)
    best: list = [len(bins), bins]
    nodes = 0
    cur: list[list[int]] = []
    load: list[int] = []
    left = [sum(sizes[j] for j in order[k:]) for k in range(len(order) + 1)]

    def go(k: int) -> bool:  # True: stop the search (bound reached or node limit)
        nonlocal nodes
        nodes += 1
        if nodes > node_limit:
            return True
        if k == len(order):
            best[0], best[1] = len(cur), [list(b) for b in cur]
            return best[0] <= bound
        spare = sum(cap - x for x in load)
        if len(cur) + max(0, -(-(left[k] - spare) // cap)) >= best[0]:
            return False
        i, tried = order[k], set()
        for b in range(len(cur)):
            if load[b] + sizes[i] <= cap and load[b] not in tried:
                tried.add(load[b])  # bins of equal load are interchangeable
                cur[b].append(i)
                load[b] += sizes[i]
                stop = go(k + 1)
                cur[b].pop()
                load[b] -= sizes[i]
                if stop:
                    return True
        if len(cur) + 1 < best[0]:
            cur.append([i])
            load.append(sizes[i])
            stop = go(k + 1)
            cur.pop()
            load.pop()
            return stop
        return False

    go(0)
    return Packing(best[1], nodes <= node_limit)
