"""Faults of the stack protocol's own paths (``harness.stack``), planted into the harness's stack behind it."""

from __future__ import annotations

import copy


def make_sharpen_a_copy(original):
    """``sharpen`` scales the query and key rows of a copy of the model: the model the sharp step trains is the plain
    one, so its lines compare two plain step 1s (and pass a position bug that bf16's bands pass)."""
    def sharpen_queries_and_keys(model, scale):
        return original(copy.deepcopy(model), scale)
    return sharpen_queries_and_keys
