"""``harness.runtime.native_wgrad``: the fused weight mode's accumulation as a C++ operator. It gives the Python
kernel's sums bit for bit, runs only where ``DCP_HARNESS_NATIVE_WGRAD`` chooses it, never in place of a planted
seam, and a build that fails is one message naming the fix. Building it takes ~1 min of a 2-core CPU, so the tests
that build are the slow suite's (and the GPU suite's, where ``auto`` uses it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.runtime import fused_linear, native_wgrad
from harness.runtime import weight_cache as wc
from harness.runtime.model import MODELS, TinyLM

ROOT = Path(__file__).resolve().parents[2]


def test_the_choice_is_one_of_three(monkeypatch):
    monkeypatch.setenv(native_wgrad.ENV, "yes")
    with pytest.raises(ValueError, match="DCP_HARNESS_NATIVE_WGRAD='yes': choose one of auto, off, on"):
        native_wgrad.choice()


@pytest.mark.parametrize("value", ["auto", "off", ""])
def test_a_machine_without_a_gpu_keeps_the_python_kernel_without_building(monkeypatch, value):
    if torch.cuda.is_available():
        pytest.skip("a machine without a GPU")
    monkeypatch.setenv(native_wgrad.ENV, value)
    monkeypatch.setattr(native_wgrad, "load", lambda: pytest.fail("built without a GPU"))
    monkeypatch.setitem(native_wgrad._STATE, "decided", None)
    monkeypatch.setattr(native_wgrad, "DEVICES", frozenset({"stale"}))
    assert native_wgrad.prepare() == frozenset()


def test_a_build_that_fails_is_one_error_naming_the_fix(tmp_path):
    """A real build with a compiler that fails (``CXX=false``), in a process of its own: the error names the
    missing pieces and ``DCP_HARNESS_NATIVE_WGRAD=off``; asked again, it does not build again."""
    code = ("from harness.runtime import native_wgrad as n\n"
            "for _ in range(2):\n"
            "    try:\n        n.load()\n    except n.NativeBuildError as e:\n        print(e)\n")
    env = {**os.environ, "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path), native_wgrad.ENV: "on"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2 and lines[0] == lines[1], (r.stdout, r.stderr[-2000:])
    assert lines[0].startswith("the C++ weight-gradient accumulation did not build (")
    assert lines[0].endswith("it needs a C++ compiler, ninja and Python's headers, or set DCP_HARNESS_NATIVE_WGRAD=off")


def _ops_run(fn) -> set[str]:
    """The dispatcher operators ``fn`` ran whose names start with ``dcp_harness::`` (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("dcp_harness::")}


def _fused_grads(device: str = "cpu", bf16: bool = False, compiled: str | None = None) -> tuple[dict, set[str]]:
    """One fused-mode step of three micro-batches of the tiny model: its gradients and the accumulation
    operators it ran."""
    from suites.runtime.test_weight_cache import _step_grads

    torch.manual_seed(0)
    wc.release()
    m = TinyLM(MODELS["tiny-gpt"]).to(device)
    if compiled:
        m.compile_blocks(compiled, scope="chain")
    out = {}
    try:
        ops = _ops_run(lambda: out.update(grads=_step_grads(m, "fused", bf16, flat=True, device=device)[1]))
    finally:
        m.compile_blocks(None)
    return out["grads"], ops


@pytest.mark.slow
def test_the_cpp_kernel_sums_what_the_python_kernel_sums_and_runs_only_where_chosen(monkeypatch):
    monkeypatch.setenv(native_wgrad.ENV, "on")
    op = native_wgrad.load()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        go, x = torch.randn(2, 9, 6, generator=g).to(dtype), torch.randn(2, 9, 5, generator=g).to(dtype)
        base = torch.randn(6, 5, generator=g)
        a, b = base.clone(), base.clone()
        op(a, go, x)
        fused_linear._ACCUMULATE(b, go, x) if dtype == torch.float32 else b.addmm_(
            go.reshape(-1, 6).t().float(), x.reshape(-1, 5).float())
        assert torch.equal(a, b), dtype
    native, ops_native = _fused_grads()
    assert ops_native >= {"dcp_harness::accumulate_wgrad_native"} and "dcp_harness::accumulate_wgrad" not in ops_native
    monkeypatch.setenv(native_wgrad.ENV, "off")
    python, ops_python = _fused_grads()
    assert "dcp_harness::accumulate_wgrad" in ops_python and "dcp_harness::accumulate_wgrad_native" not in ops_python
    assert native.keys() == python.keys() and all(torch.equal(native[k], python[k]) for k in python)
    # a planted seam is never bypassed: with gemm_accumulate replaced the Python kernel runs, under "on" too
    monkeypatch.setenv(native_wgrad.ENV, "on")
    monkeypatch.setattr(fused_linear, "gemm_accumulate", lambda mg, go, x: mg.copy_(go.t() @ x))
    planted, ops_planted = _fused_grads()
    assert "dcp_harness::accumulate_wgrad_native" not in ops_planted
    assert not all(torch.equal(planted[k], python[k]) for k in python)


@pytest.mark.slow
def test_the_cpp_kernel_inside_a_compiled_chain_gives_the_eager_sums(monkeypatch):
    """The operator's fake kernel lets a compiled chain (``aot_eager``) call it: the same gradients as the eager
    step within fp32 rounding of the compiled forward."""
    monkeypatch.setenv(native_wgrad.ENV, "on")
    torch._dynamo.reset()
    eager, _ = _fused_grads()
    chain, ops = _fused_grads(compiled="aot_eager")
    assert "dcp_harness::accumulate_wgrad_native" in ops
    for k in eager:
        assert torch.allclose(chain[k], eager[k], rtol=1e-5, atol=1e-7), k
