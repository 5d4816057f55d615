"""TransformerEngine's cuDNN: the one torch already runs.

TE loads cuDNN itself when it is imported (``transformer_engine.common``): it looks in ``CUDNN_HOME``, then
``CUDNN_PATH``, ``CUDA_HOME``, ``CUDA_PATH`` and ``/usr/local/cuda`` before the Python packages, and loads the first
``libcudnn.so*`` it finds into the process's global namespace. torch's wheels run their own cuDNN (the ``nvidia-cudnn``
package). Where the machine's CUDA toolkit carries another cuDNN, the process ends up with two: on one H100 with TE
installed apart from torch, ``import transformer_engine.pytorch`` stopped with ``libcudnn_heuristic.so.9: undefined
symbol ... libcudnn_graph.so.9`` (system cuDNN 9.14 against torch's 9.19; ``reports/recorded/te_backend.h100.log``).

``CUDNN_PATH`` alone does not settle it: on one H100 (2026-12-07, ``reports/recorded/te_cudnn.h100.log``) the
system's cuDNN sat in ``/lib/x86_64-linux-gnu`` (the loader's cache), TE's own search then took torch's
``libcudnn.so.9``, but loading TE's core library resolved ``libcudnn_heuristic.so.9`` - not yet loaded by torch -
through the cache to the system's 9.14 build, against torch's 9.19 ``libcudnn_graph.so.9`` (the same undefined
symbol). ``LD_LIBRARY_PATH`` at torch's directory fixes that but is read once, at process start. So
``prefer_torch_cudnn`` also loads every ``libcudnn*.so.N`` of torch's directory, ``libcudnn_graph`` first, with
``RTLD_GLOBAL`` (as TE itself does for a cuDNN package when no CUDA toolkit is found): the loader then finds each
sub-library by its name among the loaded ones. With that, TE's attention ran and matched fp32 sdpa on that machine
with ``CUDNN_PATH`` and ``LD_LIBRARY_PATH`` unset; without it, it failed.

``prefer_torch_cudnn`` does both before TE is imported, when neither ``CUDNN_HOME`` nor ``CUDNN_PATH`` is set (a
user's own choice wins) and ``DCP_HARNESS_TE_CUDNN`` is not ``system``. Every place that imports TE or megatron-core
calls it first.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
from pathlib import Path

OPT_OUT = "DCP_HARNESS_TE_CUDNN"
"""``system``: leave TE's own search alone (it then takes the CUDA toolkit's cuDNN first)."""


def _loaded_cudnn_dir(maps: str = "/proc/self/maps") -> str | None:
    """The directory of the ``libcudnn.so*`` this process has loaded (torch loads it at import on CUDA builds)."""
    try:
        with open(maps) as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith("libcudnn.so"):
                    return os.path.dirname(path)
    except OSError:
        return None
    return None


def _package_cudnn_dir() -> str | None:
    """The ``lib`` directory of the ``nvidia.cudnn`` package torch's wheels depend on, if it holds ``libcudnn.so*``."""
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "lib"
        if glob.glob(str(lib / "libcudnn.so*")):
            return str(lib)
    return None


def torch_cudnn_dir() -> str | None:
    """Where torch's cuDNN lives: the loaded library's directory, else the ``nvidia.cudnn`` package's; None when
    torch runs without one (a CPU build)."""
    return _loaded_cudnn_dir() or _package_cudnn_dir()


def cudnn_libraries(directory: str) -> list[str]:
    """The cuDNN libraries of ``directory`` (``libcudnn*.so.N``) in the order they are loaded: ``libcudnn_graph``
    first (the others need it), then by name."""
    return sorted(glob.glob(os.path.join(directory, "libcudnn*.so.*[0-9]")),
                  key=lambda p: ("libcudnn_graph" not in os.path.basename(p), os.path.basename(p)))


@functools.lru_cache(maxsize=1)
def prefer_torch_cudnn() -> str | None:
    """Set ``CUDNN_PATH`` to torch's cuDNN for TE's loader and load torch's cuDNN libraries into the process's global
    namespace, unless the user set ``CUDNN_HOME`` / ``CUDNN_PATH`` or opted out; returns the directory, or None. Call it
    before the first import of TransformerEngine (later it changes nothing: TE has loaded its cuDNN)."""
    directory = choose(os.environ, torch_cudnn_dir())
    if directory:
        for path in cudnn_libraries(directory):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return directory


def choose(environ, found: str | None) -> str | None:
    """``prefer_torch_cudnn``'s rule on an environment mapping and torch's cuDNN directory ``found``."""
    if environ.get(OPT_OUT, "").lower() == "system" or environ.get("CUDNN_HOME") or environ.get("CUDNN_PATH"):
        return None
    if not found:
        return None
    environ["CUDNN_PATH"] = found
    return found
