"""The TransformerEngine CP exchange's checks that run without TE: its names, the one-line refusals when TE or a
CUDA device is missing, and the audit of the group a kept TE module holds (real gloo groups)."""

from __future__ import annotations

import importlib.util
import types

import pytest

from harness.jobs.launch import run_on_ranks
from harness.parallel import te_cp
from harness.parallel.audit import GroupAuditError
from harness.parallel.cp_attention import choose_exchange
from harness.plan.errors import PlanInputError

pytestmark = pytest.mark.dist_cpu


def test_te_exchange_names():
    assert [te_cp.comm_type(f"te:{k}") for k in te_cp.COMM_TYPES] == list(te_cp.COMM_TYPES)
    assert te_cp.comm_type("gather") is None and choose_exchange("te:a2a", 4096, "cpu", 2) == "te:a2a"
    with pytest.raises(PlanInputError, match="unknown TransformerEngine CP communication type 'ring'"):
        te_cp.comm_type("te:ring")


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here")
def test_missing_te_names_what_to_install():
    with pytest.raises(te_cp.TEUnavailableError, match=r'pip install "transformer-engine\[pytorch\]==2.20.2"'):
        te_cp.require_te("cuda")


def _kept_module(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, other = pair[rank // 2], pair[1 - rank // 2]
    module = types.SimpleNamespace(cp_group=None)  # what a TE module keeps between calls: its cp_group
    seen = []
    te_cp.check_module_group(module, None, rank)  # no group held, none wanted: a one-rank block
    module.cp_group = mine
    te_cp.check_module_group(module, mine, rank, microbatch=0)
    for held, want, m in ((mine, None, 1), (other, mine, 2)):  # kept from an earlier micro-batch / another block
        module.cp_group = held
        try:
            te_cp.check_module_group(module, want, rank, microbatch=m)
        except GroupAuditError as e:
            seen.append(str(e))
    return seen


def test_a_kept_te_group_of_another_micro_batch_is_refused(tmp_path):
    for rank, seen in enumerate(run_on_ranks(_kept_module, world_size=4, tmp_path=tmp_path)):
        assert len(seen) == 2, seen
        assert f"rank {rank}, micro-batch 1" in seen[0] and f"ranks [{rank}]" in seen[0]
        assert "micro-batch 2" in seen[1]
