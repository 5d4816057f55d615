"""``bench step`` on GPUs (``pytest -m gpu suites/gpu``): the NCCL + bf16 path of the step benchmark
runs end to end on 2 GPUs with the benchmark model, every arm yields times and a kernel breakdown.
The measurement and its targets are ``dcp-harness bench step`` (a benchmark, not a test)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def test_bench_step_runs_on_two_gpus(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from harness.bench import step
    from harness.bench.trace import PARTS
    from harness.jobs.entry import launch

    over = {"warmup": 1, "iters": 2, "profile_iters": 1, "microbatches": 2, "runs": 1}
    res = launch(step.JOB, 2, tmp_path / "step.json", over)
    s = step.summarize(res, step.StepBenchConfig.from_dict(over))
    for label, a in s["arms"].items():
        b = a["breakdown"]
        print(label, f"{a['trimmed_mean_ms']:.1f} ms", f"MFU {a['mfu']:.3f}", {p: round(b[p], 2) for p in PARTS})
        assert b and b["source"] == "device", a["breakdown_error"]
        assert b["linear"] > 0 and b["attention"] > 0
        assert sum(b[p] for p in PARTS) == pytest.approx(b["wall"], rel=1e-6)
        assert 0 < a["mfu"] < 1 and a["peak_memory_gb"] > 1
        assert all(a["phases_ms"][p] > 0 for p in step.PHASES)  # CUDA-event phases, gradients overlapped
        # each rank's lead over its GPU: a pass of every measured step, never reached by the GPU before its host
        for lead in a["host_lead_per_rank"]:
            assert lead["passes"] >= 2 * 2 and lead["median_ms"] > -0.01 and 0 <= lead["starved"] <= 1
            # each pass's time on the host and on the GPU (start to the next pass's start)
            assert lead["host_forward_ms"] > 0 and lead["device_forward_ms"] > 0 and lead["device_backward_ms"] > 0
    assert s["arms"]["thd:dp-balanced"]["breakdown"]["communication"] > 0  # static CP 2 exchanges K/V


def test_each_arm_reports_the_peak_memory_of_its_own_steps(tmp_path):
    """One GPU, two arms that differ only in how the step makes its bf16 weights: casting at each use keeps a copy
    per use saved for the backward, the step's copies one per weight, so the per-call arm peaks higher (one H100, 12
    layers of h2048, two micro-batches: 29.4 against 28.1 GiB). A peak read once for the whole interleaved run gives
    both arms the same figure (29.4 and 29.4: this test fails)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from harness.bench import step
    from harness.jobs.entry import launch

    over = {"warmup": 1, "iters": 2, "profile_iters": 0, "microbatches": 2, "runs": 1,
            "arms": ["dcp:balanced", "dcp:balanced%per-call"]}
    res = launch(step.JOB, 1, tmp_path / "step.json", over)
    peaks = {k: a["peak_memory_gb"] for k, a in step.summarize(res, step.StepBenchConfig.from_dict(over))["arms"].items()}
    print(peaks)
    assert peaks["dcp:balanced%per-call"] > peaks["dcp:balanced"] + 0.1, peaks


def test_two_warm_up_steps_leave_the_compiles_out_of_the_measured_steps(tmp_path):
    """One GPU, the CUDA default (the model compiled as one chain per micro-batch), two arms whose steps compile
    different graphs: with two warm-up steps no measured step compiles (``harness.bench.compiles``; with one, a
    compiled arm recompiles at its first new shape inside the measured steps, which the check names)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from harness.bench import step
    from harness.jobs.entry import launch

    over = {"warmup": 2, "iters": 3, "profile_iters": 0, "microbatches": 2, "runs": 1,
            "arms": ["dcp:balanced", "dcp:balanced%per-call"]}
    res = launch(step.JOB, 1, tmp_path / "step.json", over)
    s = step.summarize(res, step.StepBenchConfig.from_dict(over))
    print({k: (a["compiles"], [round(x, 1) for x in a["step_ms"]]) for k, a in s["arms"].items()})
    assert s["compile"] == "inductor/chain"
    (c,) = [c for c in step.checks(s, "cuda") if c.get("validity")]
    assert c["pass"] is True and c["shown"] == "0 of 6 steps compiled", c
