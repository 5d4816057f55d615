"""A result computed once per test session and shared by the pytest-xdist workers.

A suite that runs a gloo world and judges many tests from its results (the fault catalogue's scenarios, the pipeline
references) keeps them per process; under ``pytest -n 2`` both workers would otherwise run the same world, each
slowed by the other's ranks on the same cores. ``computed_once(tmp_path_factory, key, compute)`` runs
``compute()`` in the first worker that asks, under a file lock in the session's shared temporary folder, and pickles
the result there (written to a temporary file and renamed); a worker that asks later waits for the lock and reads the
file. Without xdist it is a per-process cache. A ``compute`` that raises writes nothing: the next worker that asks
computes again (and fails with its own error).
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable
from typing import Any

from filelock import FileLock

_MEMO: dict[str, Any] = {}


def computed_once(tmp_path_factory, key: str, compute: Callable[[], Any]) -> Any:
    if key in _MEMO:
        return _MEMO[key]
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, shared by the workers
    path = root / ("computed-once-" + re.sub(r"[^A-Za-z0-9_.-]", "_", key) + ".pickle")
    with FileLock(str(path) + ".lock"):
        if path.exists():
            value = pickle.loads(path.read_bytes())
        else:
            value = compute()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(pickle.dumps(value))
            os.replace(tmp, path)
    _MEMO[key] = value
    return value
