"""The fused weight-gradient accumulation (``harness.runtime.fused_linear``) as a C++ kernel.

In the ``fused`` weight mode every linear layer's backward calls ``dcp_harness::accumulate_wgrad`` once: the
12-layer model's step of 16 micro-batches makes ~400 such calls on each rank. That operator's kernel is Python
(reshapes, the dtype probe, then ``torch.addmm(..., out_dtype=fp32, out=main_grad)``), which a host-bound step
pays on every call, and a CP group pays at its slowest rank. This module builds the same kernel in C++ as the
operator ``dcp_harness::accumulate_wgrad_native`` (one dispatcher call into ``at::addmm_out`` with ``out_dtype``).
``prepare()``, which every fused-mode step calls as it opens (``weight_cache.cached_weights``), decides per process
for which device types it runs (``DEVICES``), building or loading it first; ``fused_linear.linear_wgrad`` then calls
a forward operator of its own whose backward uses it. The choice is thus in the compiled graph itself: a graph
compiled with it, found in Inductor's caches by a later process, is never run where the library was not loaded or
not chosen.

It is built with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler, ninja and Python's headers; the source
is C++ only, no CUDA toolchain) once per machine and torch build, into torch's extension folder
(``TORCH_EXTENSIONS_DIR``); the ranks of a job that build it at once wait for the first (torch's file lock).

``DCP_HARNESS_NATIVE_WGRAD`` chooses:

- ``auto`` (default): the C++ kernel for CUDA tensors where it builds; a build that fails says why once and the
  Python kernel runs;
- ``off``: the Python kernel everywhere (the same sums: both make one GEMM accumulating into fp32);
- ``on``: the C++ kernel for every device, CPU included; a build that fails is an error (``NativeBuildError``).

The fault seam stays where it was: while ``fused_linear.gemm_accumulate`` is replaced (a planted fault), the
backward calls the Python kernel, so a planted fault is never bypassed.
"""

from __future__ import annotations

import os
import warnings

import torch

ENV = "DCP_HARNESS_NATIVE_WGRAD"
CHOICES = ("auto", "off", "on")
NAME = "dcp_harness_native_wgrad"
OP_NAME = "dcp_harness::accumulate_wgrad_native"

SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

// main_grad += go^T @ x (O x I), in main_grad's precision; go: (..., O), x: (..., I)
void accumulate_wgrad_native(at::Tensor main_grad, const at::Tensor& go, const at::Tensor& x) {
  const auto go2 = go.reshape({-1, go.size(-1)});
  const auto x2 = x.reshape({-1, x.size(-1)});
  const auto dtype = main_grad.scalar_type();
  if (main_grad.is_cuda() && go2.scalar_type() != dtype) {
    at::addmm_out(main_grad, main_grad, go2.t(), x2, dtype);  // one mixed-dtype GEMM accumulating in place
  } else {
    main_grad.addmm_(go2.t().to(dtype), x2.to(dtype));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dcp_harness, m) {
  m.def("accumulate_wgrad_native(Tensor(a!) main_grad, Tensor go, Tensor x) -> ()",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(dcp_harness, CompositeExplicitAutograd, m) {
  m.impl("accumulate_wgrad_native", &accumulate_wgrad_native);
}
"""


class NativeBuildError(RuntimeError):
    """``DCP_HARNESS_NATIVE_WGRAD=on`` and the C++ kernel could not be built or loaded."""


_STATE: dict = {"op": None, "failed": None}


def choice() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join(CHOICES)}")
    return value


def load(verbose: bool = False):
    """The built operator (``torch.ops.dcp_harness.accumulate_wgrad_native.default``), building it if need be;
    raises ``NativeBuildError`` naming what failed."""
    if _STATE["op"] is not None:
        return _STATE["op"]
    if _STATE["failed"] is not None:
        raise NativeBuildError(_STATE["failed"])
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline(name=NAME, cpp_sources=[SOURCE], is_python_module=False, verbose=verbose,
                    extra_cflags=["-O2"])
        op = torch.ops.dcp_harness.accumulate_wgrad_native.default
    except Exception as e:  # noqa: BLE001 - a compiler, ninja or header missing: the message says which
        text = " ".join(str(e).split())
        _STATE["failed"] = (f"the C++ weight-gradient accumulation did not build ({type(e).__name__}: "
                            f"{text[:400]}); it needs a C++ compiler, ninja and Python's headers, or set "
                            f"{ENV}=off")
        raise NativeBuildError(_STATE["failed"]) from None

    @torch.library.register_fake(OP_NAME)
    def _fake(main_grad, go, x):
        return None

    _STATE["op"] = op
    return op


DEVICES: frozenset = frozenset()
"""The device types whose fused linears accumulate with the C++ operator (``prepare``)."""


def prepare() -> frozenset:
    """Decide ``DEVICES`` under ``DCP_HARNESS_NATIVE_WGRAD`` (loading the operator where it is chosen) and return it:
    ``off`` none; ``auto`` CUDA where a GPU is present and it builds (a failed build warns once); ``on`` CUDA and the
    CPU, or ``NativeBuildError``. Cheap after the first call for a choice."""
    global DEVICES
    mode = choice()
    if _STATE.get("decided") == mode:
        return DEVICES
    wanted = {"off": frozenset(), "on": frozenset({"cpu", "cuda"}),
              "auto": frozenset({"cuda"}) if torch.cuda.is_available() else frozenset()}[mode]
    if wanted:
        try:
            load()
        except NativeBuildError as e:
            if mode == "on":
                raise
            warnings.warn(f"{e}; the Python kernel runs", RuntimeWarning, stacklevel=2)
            wanted = frozenset()
    DEVICES, _STATE["decided"] = wanted, mode
    return DEVICES
