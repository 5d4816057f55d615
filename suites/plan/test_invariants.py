"""Every scheduler satisfies every invariant of spec 2.7 on every valid input (hypothesis).

``pytest --impl megatron-core`` runs the same properties against the installed upstream
``BalancedCPScheduler`` (no min_cp / VPP there): its failures name the invariant it breaks.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given

from harness.plan import (
    ALGORITHMS,
    INDEPENDENT,
    BatchTooSmallError,
    CostModel,
    VPPAlignmentError,
    check_schedule,
    lower_bound,
    schedule,
    simulate,
)
from harness.testing import Batch, batches

COSTS = [CostModel.megatron(), CostModel.from_model_shape(num_layers=2, hidden_size=64, ffn_hidden_size=256,
                                                          num_attention_heads=4, cp_comm_flops_per_byte=500.0,
                                                          per_microbatch_flops=1e6)]
COSTS.append(__import__("dataclasses").replace(COSTS[1], cp_block=3e7, name="with a fixed cost per CP block"))
COSTS.append(__import__("dataclasses").replace(COSTS[1], per_sequence=2e7, name="with a fixed cost per sequence and rank"))


def _algorithms(impl: str) -> list[str]:
    return ["megatron-core"] if impl == "megatron-core" else list(ALGORITHMS)


def pytest_generate_tests(metafunc):
    if "algorithm" in metafunc.fixturenames:
        metafunc.parametrize("algorithm", _algorithms(metafunc.config.getoption("--impl")))


def _run(algorithm: str, batch, cost=None):
    if algorithm == "megatron-core":
        from harness.upstream import megatron

        if not megatron.available():
            pytest.skip("megatron-core is not installed")
        return megatron.sample_id_groups(batch.lengths, n_ranks=batch.n_ranks,
                                         max_seqlen_per_rank=batch.max_seqlen_per_rank)
    return schedule(batch.lengths, algorithm=algorithm, cost=cost, **batch.kwargs())


def _static_packs(batch) -> tuple[int, int]:
    """Oracle for dp-balanced's refusals: greedy pack count (spec 2.10 step 1) and the multiple."""
    longest = max(L for _, L in batch.lengths)
    cp = max(batch.min_cp_size, 1 << (-(-longest // batch.max_seqlen_per_rank) - 1).bit_length())
    cap, packs, tokens = cp * batch.max_seqlen_per_rank, 0, 0
    for _, L in batch.lengths:
        if packs and tokens + L <= cap:
            tokens += L
        else:
            packs, tokens = packs + 1, L
    return packs, (batch.n_ranks // cp) * (batch.vpp_group or 1)


@example(batch=Batch([(0, 1), (1, 2048), (2, 1)], n_ranks=2, max_seqlen_per_rank=2048))  # CI, 2026-11
@given(batch=batches())
def test_every_invariant_holds(algorithm, impl, batch):
    if impl == "megatron-core":
        batch = type(batch)(batch.lengths, batch.n_ranks, batch.max_seqlen_per_rank)  # no min_cp, no VPP
    try:
        result = _run(algorithm, batch)
    except VPPAlignmentError as e:
        assert batch.vpp_group and batch.vpp_group > 1, "only VPP alignment may refuse a valid batch"
        assert f"vpp_group={batch.vpp_group}" in str(e)
        return
    except BatchTooSmallError as e:
        # only static CP (dp-balanced) may refuse, and only when its packs cannot be split into a
        # multiple of dp x vpp_group (splitting adds one pack per step, at most one per sequence)
        assert algorithm == "dp-balanced", e
        packs, multiple = _static_packs(batch)
        assert not any(k % multiple == 0 for k in range(packs, len(batch.lengths) + 1)), e
        return
    kw = batch.kwargs() if impl == "ours" else {"n_ranks": batch.n_ranks, "max_seqlen_per_rank": batch.max_seqlen_per_rank}
    mbs = result.microbatches if hasattr(result, "microbatches") else result
    violations = check_schedule(mbs, batch.lengths, **kw)
    assert not violations, "\n".join(v.error().args[0] for v in violations[:5])


@given(batch=batches(vpp=False))
def test_deterministic_and_never_below_the_lower_bound(algorithm, impl, batch):
    if impl == "megatron-core":
        pytest.skip("determinism of upstream is not ours to assert")
    for cost in COSTS:
        try:
            a = schedule(batch.lengths, algorithm=algorithm, cost=cost, **batch.kwargs())
        except BatchTooSmallError:
            assert algorithm == "dp-balanced"
            return
        b = schedule(list(batch.lengths), algorithm=algorithm, cost=cost, **batch.kwargs())
        assert a.microbatches == b.microbatches
        lb = lower_bound(batch.lengths, cost=cost, n_ranks=batch.n_ranks,
                         max_seqlen_per_rank=batch.max_seqlen_per_rank, min_cp_size=batch.min_cp_size)
        assert simulate(a).step_time >= lb * (1 - 1e-9)


@given(batch=batches(), seed=__import__("hypothesis").strategies.randoms(use_true_random=False))
def test_balanced_is_order_free_and_never_slower_than_its_phased_plans(batch, seed):
    """Ours only: the input order does not matter (gids break ties), and the chosen schedule is never
    slower than the phased plans (which never make a CP block wait for a straggler), the candidates it
    had before it judged others too."""
    from harness.plan.balanced.candidates import phased
    from harness.plan.balanced.evaluate import Judge
    from harness.plan.balanced.items import Item
    from harness.plan.balanced.phased import PhasedBuilder
    from harness.plan.cost import cp_min

    shuffled = list(batch.lengths)
    seed.shuffle(shuffled)
    n, mslpr, min_cp, vpp = batch.n_ranks, batch.max_seqlen_per_rank, batch.min_cp_size, batch.vpp_group
    vpp = vpp if vpp and vpp > 1 else None
    for cost in COSTS:
        try:
            a = schedule(batch.lengths, cost=cost, **batch.kwargs())
        except VPPAlignmentError:
            with pytest.raises(VPPAlignmentError):
                schedule(shuffled, cost=cost, **batch.kwargs())
            return
        assert schedule(shuffled, cost=cost, **batch.kwargs()).microbatches == a.microbatches
        items = [Item(g, L, cp_min(L, mslpr, min_cp), cost) for g, L in sorted(batch.lengths)]
        judge = Judge(items, n, mslpr, cost, INDEPENDENT, min_cp, vpp)
        plans = [p for p, _ in phased(PhasedBuilder(items, n, mslpr, min_cp, vpp, cost), n, min_cp)[0]
                 if judge.feasible(p)]
        if plans:
            assert simulate(a).step_time <= min(map(judge.time, plans)) * (1 + 1e-12)


PER_MB_HEAVY = CostModel.from_model_shape(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                                          cp_comm_flops_per_byte=500.0, per_microbatch_flops=3e8)


@given(batch=batches())
def test_balanced_prediction_is_the_simulated_step_time(batch):
    """Ours only: the step time ``balanced`` minimises is exactly ``simulate``'s, for every cost model,
    including one that charges heavily per micro-batch, and the schedule is valid under each."""
    from harness.plan.balanced import plan_balanced

    for cost in COSTS + [PER_MB_HEAVY]:
        try:
            rows, predicted = plan_balanced(list(batch.lengths), batch.n_ranks, batch.max_seqlen_per_rank,
                                            batch.min_cp_size, batch.vpp_group, cost)
        except VPPAlignmentError:
            return
        s = schedule(batch.lengths, cost=cost, **batch.kwargs())
        assert simulate(s).step_time == pytest.approx(predicted, rel=1e-9, abs=1e-6)
        violations = check_schedule(s.microbatches, batch.lengths, **batch.kwargs())
        assert not violations, "\n".join(v.error().args[0] for v in violations[:5])


def _widths_reference(builder, theta, leaf):
    """``_Builder.widths`` as first written: every item's width from scratch, then one pass over all
    widths per depth (the faster one skips items that cannot widen and counts widths instead)."""
    from harness.plan.balanced.items import Infeasible as _Infeasible

    n, limit = builder.n, theta * builder.target
    width = {}
    for it in builder.items:
        w = max(it.cp, leaf)
        while w < n and it.cost(w) > limit and it.cost(2 * w) < it.cost(w):
            w *= 2
        width[it.gid] = w
    s = leaf
    while s < n:
        at = [g for g, w in width.items() if w == s]
        if at and sum(1 for w in width.values() if w <= s) < n // s:
            if s == leaf:
                raise _Infeasible(f"fewer sequences than {n // s} leaves")
            for g in at:
                width[g] = 2 * s
        s *= 2
    return width


@given(batch=batches(max_log_ranks=6, max_sequences=96))
def test_balanced_widths_match_the_reference(batch):
    """Node sizes (and the infeasible leaves) of every candidate ``plan_balanced`` may try, under cost
    models that widen long sequences (communication-free ``L**2``) or rarely do."""
    from harness.plan.balanced.items import Infeasible as _Infeasible
    from harness.plan.balanced.items import Item as _Item
    from harness.plan.balanced.phased import THETAS
    from harness.plan.balanced.phased import PhasedBuilder as _Builder
    from harness.plan.cost import cp_min

    for cost in COSTS:
        items = [_Item(g, L, cp_min(L, batch.max_seqlen_per_rank, batch.min_cp_size), cost) for g, L in batch.lengths]
        builder = _Builder(items, batch.n_ranks, batch.max_seqlen_per_rank, batch.min_cp_size, None, cost)
        leaf = batch.min_cp_size
        while leaf <= batch.n_ranks:
            for theta in THETAS:
                try:
                    want = _widths_reference(builder, theta, leaf)
                except _Infeasible as e:
                    with pytest.raises(_Infeasible, match=f"^{e}$"):
                        builder.widths(theta, leaf)
                    continue
                got = builder.widths(theta, leaf)
                assert list(got.items()) == list(want.items())  # the order too: ``plan`` relies on it
            leaf *= 2
