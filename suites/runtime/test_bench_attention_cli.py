"""``dcp-harness bench attention`` off the GPU: bad input is refused with exit 2 before anything
launches, and the summary's efficiency arithmetic (the GPU run itself is recorded under
``reports/recorded``)."""

from __future__ import annotations

import pytest
import torch

from harness.bench import attention
from harness.cli import main


def test_unknown_backend_exits_2_naming_it_and_the_choices(capsys):
    assert main(["bench", "attention", "--backend", "flash3"]) == 2
    got = capsys.readouterr()
    assert "'flash3'" in got.err and "flash, varlen" in got.err and not got.out  # errors go to stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
def test_refuses_without_gpus(capsys):
    assert main(["bench", "attention"]) == 2
    got = capsys.readouterr()
    assert "needs CUDA" in got.err and not got.out


def test_summary_takes_the_slowest_rank_and_divides_by_cp_times_time():
    def row(cp, s, comm=None):
        r = {"tokens": 1024, "sequences": 1, "cp": cp, "seconds": s, "flops": 7e12}
        return r if comm is None else {**r, "comm_seconds": comm, "attention_seconds": s - comm}

    ranks = [[row(1, 1.0), row(2, 0.6, 0.1)], [row(1, 1.2), row(2, 0.5, 0.2)]]
    base, cp2 = attention.summarize(ranks)
    assert base["seconds"] == 1.2 and base["efficiency"] == 1.0
    assert cp2["seconds"] == 0.6 and cp2["comm_ms"] == pytest.approx(200.0)
    assert cp2["efficiency"] == pytest.approx(1.2 / (2 * 0.6))
    assert cp2["tflops"] == pytest.approx(7e12 / 0.6 / 1e12)
