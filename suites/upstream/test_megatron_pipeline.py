"""Differential: our PP / VPP layer ranges against megatron-core 0.16.1's ``get_transformer_layer_offset``
and ``get_num_layers_to_build``; and its ``RouterReplay`` against our replay store.

Every configuration of the grid falls in one of four explained classes:
- both give the same ranges;
- both refuse it (upstream asserts, we raise ``ValueError``);
- we refuse it and upstream's helpers return layer sets that are *not* a partition of the model
  (negative counts when first + last > L, first/last or VPP ignored at PP = 1, ...): an upstream
  validation gap - its ``TransformerConfig`` accepts these configs;
- upstream divides by zero (uneven split with both first and last set plus VPP on 2 stages) where
  our ranges partition the model.
"""

from __future__ import annotations

import itertools
import warnings

import pytest

from harness.plan import PlanInputError
from harness.plan.pipeline import layer_ranges

pytestmark = pytest.mark.upstream


def upstream_ranges(L, P, first, last, V, emb, loss):
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_config import TransformerConfig
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        c = TransformerConfig(num_layers=L, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=P,
                              num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                              virtual_pipeline_model_parallel_size=V, account_for_embedding_in_pipeline_split=emb,
                              account_for_loss_in_pipeline_split=loss, pipeline_dtype=torch.float32)
        return [[(get_transformer_layer_offset(c, vp_stage=v if V else None, pp_rank=p),
                  get_num_layers_to_build(c, vp_stage=v if V else None, pp_rank=p)) for v in range(V or 1)]
                for p in range(P)]


def partitions(ranges, L) -> bool:
    return sorted(i for st in ranges for s, n in st for i in range(s, s + max(n, 0))) == list(range(L)) and \
        all(n >= 0 for st in ranges for _, n in st)


GRID = list(itertools.product([6, 8, 12, 16, 27, 48], [1, 2, 4], [None, 1, 4, 10], [None, 2, 10], [None, 2],
                              [False, True], [False, True]))


def test_layer_ranges_agree_with_megatron_or_the_difference_is_explained():
    classes: dict[str, int] = {}
    for L, P, first, last, V, emb, loss in GRID:
        try:
            ours = layer_ranges(L, P, first=first, last=last, vpp_size=V, account_embedding=emb, account_loss=loss)
        except PlanInputError:
            ours = None
        try:
            theirs, err = upstream_ranges(L, P, first, last, V, emb, loss), None
        except Exception as e:  # noqa: BLE001 - classified below
            theirs, err = None, e
        if ours is not None and theirs is not None:
            assert ours == theirs, (L, P, first, last, V, emb, loss, ours, theirs)
            cls = "equal"
        elif ours is None and theirs is None:
            cls = "both refuse"
        elif ours is None:
            assert not partitions(theirs, L), ("we refuse a valid split", L, P, first, last, V, emb, loss, theirs)
            cls = "upstream returns a non-partition"
        else:
            assert isinstance(err, ZeroDivisionError) and first and last and V and P == 2, \
                ("unexplained upstream refusal", L, P, first, last, V, emb, loss, repr(err))
            assert partitions(ours, L)
            cls = "upstream divides by zero"
        classes[cls] = classes.get(cls, 0) + 1
    assert classes["equal"] > 100 and classes["upstream returns a non-partition"] > 0
    assert classes["upstream divides by zero"] > 0


@pytest.fixture
def registry():
    from harness.upstream.megatron import _import  # noqa: F401 - quiet import of megatron.core

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    RouterReplay.clear_global_router_replay_instances()
    yield RouterReplay, RouterReplayAction
    RouterReplay.clear_global_router_replay_instances()


def test_upstream_registry_is_instantiation_order_which_is_not_layer_order_under_vpp(registry):
    """VPP stage 0 of L=8, PP=2, VPP=2 builds layers 0, 1 (chunk 0) and 4, 5 (chunk 1). Upstream hands
    replay data to routers by instantiation order: the usual ``per_layer[offset : offset + n]`` gives the
    chunk-1 routers the data of layers 2 and 3. Our store is keyed by global layer."""
    import torch

    from harness.plan.pipeline import layer_ranges, stage_layers
    from harness.runtime.replay import ReplayStore

    RouterReplay, _ = registry
    layers = stage_layers(layer_ranges(8, 2, vpp_size=2)[0])
    assert layers == [0, 1, 4, 5]
    routers = [RouterReplay() for _ in layers]
    per_layer = [torch.full((3, 2), i) for i in range(8)]
    RouterReplay.set_replay_data(per_layer[0:4])  # offset 0, 4 local routers
    assert [int(r.target_topk_idx[0, 0]) for r in routers] == [0, 1, 2, 3] != layers
    store = ReplayStore()
    for i in range(8):
        store.put(i, 0, 0, per_layer[i])
    assert [int(store.get(i, 0, 0)[0, 0]) for i in layers] == layers


def test_upstream_backward_fifo_desyncs_under_an_interleaved_schedule(registry):
    """Each per-(micro-batch, chunk) setup appends to *every* instance's backward FIFO; with two chunks
    the recompute of micro-batch 0's chunk-1 router pops micro-batch 0's chunk-0 call instead."""
    import torch

    RouterReplay, Action = registry
    chunk0, chunk1 = RouterReplay(), RouterReplay()
    for mb in range(2):
        for chunk in range(2):  # interleaved forward: (mb0, c0), (mb0, c1), (mb1, c0), (mb1, c1)
            RouterReplay.set_replay_data([torch.full((1, 1), 10 * mb + chunk)] * 2)
    chunk1.set_router_replay_action(Action.REPLAY_BACKWARD)
    scores = torch.zeros(1, 32)
    _, popped = chunk1.get_replay_topk(scores, 1)
    assert int(popped) == 0  # wanted the (mb0, chunk1) data = 1: the FIFO holds 4 entries for 2 micro-batches
    assert len(chunk0.replay_backward_list) == 4


def test_upstream_replay_gathers_live_scores_like_ours(registry):
    import torch

    RouterReplay, Action = registry
    r = RouterReplay()
    idx = torch.tensor([[3, 1], [0, 2]])
    r.set_target_indices(idx)
    r.set_router_replay_action(Action.REPLAY_FORWARD)
    scores = torch.randn(2, 4, requires_grad=True)
    probs, top = r.get_replay_topk(scores, 2)
    assert torch.equal(top, idx) and torch.equal(probs, scores.gather(1, idx))
    probs.sum().backward()
    assert scores.grad.abs().sum() > 0
