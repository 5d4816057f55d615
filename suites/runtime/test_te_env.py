"""``harness.runtime.te_env``: TransformerEngine is pointed at the cuDNN torch runs, unless the user chose one.

The rule on environment mappings, and the two ways torch's cuDNN is found (the library this process loaded, read from
a maps file; the ``nvidia.cudnn`` package's ``lib``), on files laid out as on a CUDA machine. That TE's loader honours
``CUDNN_PATH`` is a GPU fact: ``suites/runtime/test_attention.py``'s TE backend test imports TE through it."""

from __future__ import annotations

import sys

import pytest

from harness.runtime import te_env

TORCH_LIB = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib"


@pytest.mark.parametrize("env, found, want", [
    ({}, TORCH_LIB, TORCH_LIB),
    ({}, None, None),  # a CPU build of torch: nothing to prefer
    ({"CUDNN_PATH": "/mine"}, TORCH_LIB, None),
    ({"CUDNN_HOME": "/mine"}, TORCH_LIB, None),  # TE reads CUDNN_HOME before CUDNN_PATH
    ({"DCP_HARNESS_TE_CUDNN": "system"}, TORCH_LIB, None),
], ids=["unset", "no-torch-cudnn", "user-path", "user-home", "opt-out"])
def test_cudnn_path_is_set_only_when_the_user_chose_none(env, found, want):
    before = dict(env)
    assert te_env.choose(env, found) == want
    assert env == ({**before, "CUDNN_PATH": want} if want else before)


def test_the_loaded_library_s_directory_is_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f10 r-xp 00000000 08:01 42 /usr/local/cuda/lib64/libcudnn_graph.so.9.14.0\n"
                    f"7f10-7f20 r-xp 00000000 08:01 43 {TORCH_LIB}/libcudnn.so.9\n"
                    "7f20-7f30 rw-p 00000000 00:00 0\n")
    assert te_env._loaded_cudnn_dir(str(maps)) == TORCH_LIB
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 42 /usr/lib/libc.so.6\n")
    assert te_env._loaded_cudnn_dir(str(maps)) is None
    assert te_env._loaded_cudnn_dir(str(tmp_path / "absent")) is None


def test_the_nvidia_cudnn_package_s_lib_is_found_when_it_holds_the_library(tmp_path, monkeypatch):
    lib = tmp_path / "nvidia" / "cudnn" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "nvidia" / "cudnn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    assert te_env._package_cudnn_dir() is None  # the package without the library
    (lib / "libcudnn.so.9").write_bytes(b"")
    assert te_env._package_cudnn_dir() == str(lib)


def test_torch_s_cudnn_libraries_load_graph_first(tmp_path):
    """``prefer_torch_cudnn`` loads these RTLD_GLOBAL so that TE's core library finds every cuDNN sub-library among the
    loaded ones (``reports/recorded/te_cudnn.h100.log``); the others need ``libcudnn_graph``."""
    for name in ["libcudnn.so.9", "libcudnn_heuristic.so.9", "libcudnn_graph.so.9", "libcudnn_ops.so.9",
                 "libcudnn.so", "libcudnn_graph.so.9.19.0.headers", "libnccl.so.2"]:
        (tmp_path / name).write_bytes(b"")
    got = [p.rsplit("/", 1)[-1] for p in te_env.cudnn_libraries(str(tmp_path))]
    assert got == ["libcudnn_graph.so.9", "libcudnn.so.9", "libcudnn_heuristic.so.9", "libcudnn_ops.so.9"]
