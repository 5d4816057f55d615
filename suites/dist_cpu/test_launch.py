"""``run_on_ranks``: results in rank order; a failing rank is reported as itself (not its partners'
connection errors), a rank that dies silently is named, and nothing hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness.jobs.launch import RankFailure, run_on_ranks

pytestmark = pytest.mark.dist_cpu


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, float(t)


def _raises_on_1(rank, world):
    dist.barrier()
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))


def _dies_on_2(rank, world):
    dist.barrier()
    if rank == 2:
        os._exit(13)
    dist.all_reduce(torch.ones(1))


def _hangs_on_0(rank, world):
    if rank == 0:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


def test_results_in_rank_order(tmp_path):
    assert run_on_ranks(_sum_ranks, world_size=3, tmp_path=tmp_path) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_the_raising_rank_is_reported_not_its_partners(tmp_path):
    with pytest.raises(RankFailure) as e:
        run_on_ranks(_raises_on_1, world_size=4, tmp_path=tmp_path, timeout_s=20)
    assert e.value.rank == 1 and "ValueError: boom on rank 1" in str(e.value)
    assert str(e.value).startswith("rank 1 failed first")
    assert (e.value.world_dir / "rank1.traceback").exists()


def test_a_rank_that_dies_silently_is_named(tmp_path):
    t = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(_dies_on_2, world_size=4, tmp_path=tmp_path, timeout_s=20)
    assert e.value.rank == 2 and "exit code 13 without a Python traceback" in str(e.value)
    assert time.monotonic() - t < 60


def test_a_hung_rank_makes_the_world_fail_within_the_timeout(tmp_path):
    t = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(_hangs_on_0, world_size=2, tmp_path=tmp_path, timeout_s=2, start_timeout_s=30)
    assert time.monotonic() - t < 60
    assert e.value.rank == 0 and "still running at the deadline (killed)" in str(e.value)
    assert "rank 1:" in str(e.value)  # its timeout is listed as a consequence


def _env_of(rank: int, world: int) -> str | None:
    import os

    return os.environ.get("DCP_HARNESS_TEST_ENV")


def test_ranks_get_the_callers_environment_at_the_call(tmp_path, monkeypatch):
    """The fork server starts once per process; a variable set after that still reaches every rank (as with
    ``spawn``), and one removed is gone."""
    run_on_ranks(_env_of, world_size=2, tmp_path=tmp_path / "a")  # the server is running from here on
    monkeypatch.setenv("DCP_HARNESS_TEST_ENV", "set after the server started")
    assert run_on_ranks(_env_of, world_size=2, tmp_path=tmp_path / "b") == ["set after the server started"] * 2
    monkeypatch.delenv("DCP_HARNESS_TEST_ENV")
    assert run_on_ranks(_env_of, world_size=2, tmp_path=tmp_path / "c") == [None, None]
