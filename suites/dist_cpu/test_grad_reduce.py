"""``harness.parallel.grad_reduce``: bucketed gradient all-reduce overlapped with the last backward.

The reduced buffer must equal one all-reduce of the fully accumulated gradients (earlier
micro-batches are never reduced on their own), buckets must launch in index order on every rank
(from hooks during the backward when they can), and bad buffers are refused with the fix."""

from __future__ import annotations

import pytest
import torch

from harness.jobs.launch import run_on_ranks
from harness.parallel.grad_reduce import BucketedGradReducer, GradReduceError

pytestmark = pytest.mark.dist_cpu


class _Net(torch.nn.Module):
    """Three layers, plus a side branch the last micro-batch does not use (no gradient then)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.side = torch.nn.Linear(16, 4)

    def forward(self, x, use_side: bool):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(h).square().sum() + (self.side(h).square().sum() if use_side else 0.0)


def _flat_grads(model, device):
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), device=device)
    off = 0
    for p in params:
        p.grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    return params, flat


def _net(device):
    torch.manual_seed(0)
    return _Net().to(device)


def test_buckets_tile_the_buffer_in_reverse_parameter_order():
    model = _net("cpu")
    params, flat = _flat_grads(model, "cpu")
    r = BucketedGradReducer(params, flat, bucket_elements=100)
    assert r.buckets[0][1] == flat.numel() and r.buckets[-1][0] == 0  # bucket 0 holds the last parameters
    assert all(r.buckets[i + 1][1] == r.buckets[i][0] for i in range(len(r.buckets) - 1))  # contiguous
    assert all(hi - lo >= 100 for lo, hi in r.buckets[:-1])  # only the last bucket may be smaller
    one = BucketedGradReducer(params, flat, bucket_elements=10**9)
    assert one.buckets == [(0, flat.numel())]
    r.close()
    one.close()


def test_an_incomplete_bucket_holds_back_the_later_ones_until_finish():
    """Without a process group nothing is sent, but the launch bookkeeping is the real one."""
    model = _net("cpu")
    params, flat = _flat_grads(model, "cpu")
    r = BucketedGradReducer(params, flat, bucket_elements=1)  # one bucket per parameter
    assert len(r.buckets) == len(params)
    x = torch.randn(5, 8)
    r.arm()
    model(x, use_side=True).backward()
    assert r.launched_in_backward == len(r.buckets) and r.launch_order == list(range(len(r.buckets)))
    r.finish()
    r.arm()
    model(x, use_side=False).backward()  # side.weight / side.bias (buckets 0 and 1: the last parameters) get nothing
    assert r.launched_in_backward == 0  # bucket 0 never completes, so nothing may launch before it
    r.finish()
    assert r.launch_order == list(range(len(r.buckets)))
    r.close()


def test_bad_buffers_are_refused_with_the_fix():
    model = _net("cpu")
    params, flat = _flat_grads(model, "cpu")
    with pytest.raises(GradReduceError, match="bucket_elements"):
        BucketedGradReducer(params, flat, bucket_elements=0)
    params[1].grad = torch.zeros_like(params[1])  # not a view of flat
    with pytest.raises(GradReduceError, match=r"parameter 1 .*flat\[offset:offset \+ p.numel\(\)\]"):
        BucketedGradReducer(params, flat)
    params[1].grad = flat[:params[1].numel()].view_as(params[1])  # overlaps parameter 0
    with pytest.raises(GradReduceError, match="overlap"):
        BucketedGradReducer(params, flat)
    with pytest.raises(GradReduceError, match="contiguous"):
        BucketedGradReducer(params, flat.view(-1, 1))


def reduce_world(rank: int, world: int, device: str, steps: int = 2) -> dict:
    """Two models with the same weights: A reduces with the reducer (armed for the last of three
    micro-batches), B accumulates and all-reduces the whole buffer once; were an earlier micro-batch
    reduced on its own, A would count it ``world`` times."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    a, b = _net(device), _net(device)
    pa, fa = _flat_grads(a, device)
    pb, fb = _flat_grads(b, device)
    reducer = BucketedGradReducer(pa, fa, bucket_elements=150)
    out = {"equal": [], "launched": [], "orders": [], "buckets": len(reducer.buckets)}
    for step in range(steps):
        fa.zero_()
        fb.zero_()
        for k in range(3):
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
            x = torch.randn(6, 8, generator=g).to(device)
            if k == 2:
                reducer.arm()
            a(x, use_side=k != 1).backward()  # the side branch skips a middle micro-batch
            b(x, use_side=k != 1).backward()
        reducer.finish()
        dist.all_reduce(fb)
        out["equal"].append(bool(torch.equal(fa, fb)))
        out["launched"].append(reducer.launched_in_backward)
        out["orders"].append(list(reducer.launch_order))
    reducer.close()
    return out


def test_overlapped_reduction_equals_one_all_reduce_on_a_gloo_world(tmp_path):
    ranks = run_on_ranks(reduce_world, world_size=2, tmp_path=tmp_path, args=("cpu",), timeout_s=60)
    for r in ranks:
        assert r["equal"] == [True, True]
        assert r["orders"] == [list(range(r["buckets"]))] * 2
        assert r["launched"] == [r["buckets"]] * 2 and r["buckets"] >= 3  # all from hooks, during the backward
    assert ranks[0]["orders"] == ranks[1]["orders"]


def test_a_reducer_hook_is_refused_where_the_mtp_embedding_is_shared_between_stages():
    """Under a pipeline the last stage hands its embedding replica's gradient to the first stage after the backward
    (``harness.train.shared_embedding``); a hook that reduced during the backward would have summed the first stage's
    gradient without it. The step refuses before any work, naming the fix."""
    from types import SimpleNamespace

    from harness.runtime.model import TinyLM
    from harness.runtime.model_config import MODELS
    from harness.train import pipeline, step

    model = TinyLM(MODELS["tiny-gpt-mtp"])
    run = SimpleNamespace(stage=pipeline.Stage.of(model.c.layers, 2, 1, 1), groups=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GradReduceError, match=r"before the pipeline's last stage hands its embedding replica's .* "
                                              r"drop the hook .* or run pp = 1"):
        step.train_step(model, run, "dcp", [8], {}, None, None, device="cpu", opt=opt, params=[], grads=None,
                        hooks=step.StepHooks(reducer=SimpleNamespace()))


def test_a_reducer_hook_is_refused_under_sequence_parallelism():
    """Sequence parallelism sums the split norms' gradients over TP after the backward; a hook that reduced (or
    reduce-scattered) them over DP x CP during the backward would leave that sum to a buffer already handed on. The
    step refuses before any work, naming the fix."""
    from types import SimpleNamespace

    from harness.runtime.model import TinyLM
    from harness.runtime.model_config import MODELS
    from harness.train import pipeline, step

    model = TinyLM(MODELS["tiny-gpt"])
    run = SimpleNamespace(stage=pipeline.Stage.of(model.c.layers, 1, 1, 0), groups=None,
                          tp=SimpleNamespace(sequence_parallel=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GradReduceError, match=r"before sequence parallelism sums the split region's norm gradients .* "
                                              r"drop the hook .* or turn sequence parallelism off"):
        step.train_step(model, run, "dcp", [8], {}, None, None, device="cpu", opt=opt, params=[], grads=None,
                        hooks=step.StepHooks(reducer=SimpleNamespace()))
