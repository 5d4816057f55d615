"""The schedulers price the padding the runtime adds (``harness.plan.padding``).

A THD runtime pads each sequence of a block of ``c`` ranks to a multiple of ``2c`` (1 at ``c = 1``), times ``tp``
under sequence parallelism. Judged here against two references that share no code with the schedulers: the padding
rule written out by hand in this file (TransformerEngine's and Megatron's: ``2 x cp x tp``, ``tp`` alone at CP 1), and
the runtime's own packing (``harness.parallel.reroute.build_microbatches``), which pads the ranks' real rows.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from harness.data.workloads import sample
from harness.parallel.reroute import build_microbatches, sample_for
from harness.plan import PlanInputError, Schedule, check_schedule, lower_bound, schedule, simulate
from harness.plan.balanced.fit import PaddingFit
from harness.plan.balanced.items import Item
from harness.plan.cost import CostModel
from harness.plan.errors import SequenceTooLongError
from harness.plan.padding import PaddingError, SequencePadding
from harness.testing import batches
from harness.train.layouts import LayoutConfig, plan


def by_hand(L: int, size: int, tp: int, domain: int | None = None) -> int:
    """Megatron's rule, written out: the divisor of a block of ``size`` ranks, times tp under SP."""
    div = 2 * domain if domain else (2 * size if size > 1 else 1)
    div *= tp
    return (L + div - 1) // div * div


def overfull(s: Schedule, tp: int, domain: int | None = None) -> list[tuple[int, int, int]]:
    """(micro-batch, padded tokens, capacity) of every block past its capacity once padded by hand."""
    out = []
    for m, mb in enumerate(s.layout):
        for b in mb:
            tokens = sum(by_hand(s.lengths[g], b.size, tp, domain) for g in b.gids)
            if tokens > b.size * s.capacity:
                out.append((m, tokens, b.size * s.capacity))
    return out


@given(batch=batches(min_cp=False), tp=st.sampled_from([1, 2, 4, 8]), domain=st.booleans(),
       algorithm=st.sampled_from(["balanced", "dp-balanced"]),
       execution=st.sampled_from(["independent", "synchronous"]))
def test_padded_blocks_fit_their_capacity(batch, tp, domain, algorithm, execution):
    while tp > 1 and batch.max_seqlen_per_rank % (2 * tp * (batch.n_ranks if domain else 1)):
        tp //= 2  # a rank holds whole chunks
    assume(batch.max_seqlen_per_rank % (2 * tp * (batch.n_ranks if domain else 1)) == 0)
    pad = SequencePadding(tp=tp, domain=batch.n_ranks if domain else None)
    kw = dict(n_ranks=batch.n_ranks, max_seqlen_per_rank=batch.max_seqlen_per_rank, vpp_group=batch.vpp_group,
              algorithm=algorithm, execution=execution, padding=pad)
    try:
        s = schedule(batch.lengths, **kw)
    except PlanInputError as e:  # the count of micro-batches a VPP group needs is the batch's, padded or not
        assert "vpp_group" in str(e) or "dp-balanced needs" in str(e), e
        return
    assert s.padding == pad and Schedule.from_dict(s.to_dict()).to_dict() == s.to_dict()
    assert not overfull(s, tp, batch.n_ranks if domain else None)
    bad = check_schedule(s)
    assert not bad, "\n".join(v.error().args[0] for v in bad[:5])
    if batch.lengths:
        assert simulate(s).step_time >= lower_bound(batch.lengths, n_ranks=batch.n_ranks, execution=execution,
                                                    max_seqlen_per_rank=batch.max_seqlen_per_rank) * (1 - 1e-9)
        again = schedule(batch.lengths if algorithm == "dp-balanced" else list(reversed(batch.lengths)), **kw)
        assert again.microbatches == s.microbatches  # deterministic (balanced: whatever the order; dp-balanced
        # keeps upstream's order)


@pytest.mark.parametrize("tp", [2, 8])
def test_wikipedia_blocks_went_past_capacity_unpriced_and_fit_priced(tp):
    """The defect this closes: on real lengths ``balanced`` planned raw tokens and tp's padding took 4-27% of its
    blocks past their capacity; priced, none is, at a step time within 1% of the unpriced one's."""
    n, m, past, raw_time, padded_time = 8, 2048, 0, 0.0, 0.0
    for seed in range(3):
        lengths = sample(f"wikipedia:max={n * m}", 512, seed)
        raw = schedule(lengths, n_ranks=n, max_seqlen_per_rank=m)
        past += len(overfull(raw, tp))
        s = schedule(lengths, n_ranks=n, max_seqlen_per_rank=m, padding=SequencePadding(tp=tp))
        assert not overfull(s, tp) and not check_schedule(s)
        raw_time, padded_time = raw_time + simulate(raw).step_time, padded_time + simulate(s).step_time
    assert past > 0  # the raw plan would put a rank past max_seqlen_per_rank
    assert {v.invariant for v in check_schedule(raw, padding=SequencePadding(tp=tp))} <= {"capacity"}
    assert padded_time <= 1.01 * raw_time


def test_the_runtimes_padded_rows_fit_the_rank():
    """The runtime's own packing of a priced schedule under SP puts at most ``max_seqlen_per_rank`` rows on a rank;
    of an unpriced one, more."""
    n, m, tp = 4, 256, 8
    lengths = [249, 249, 9, 9, 240, 17, 120, 120, 63, 63, 500, 31, 31, 31, 31, 900]
    samples = {g: sample_for(g, L, vocab=64) for g, L in enumerate(lengths)}

    def most_rows(s: Schedule) -> int:
        return max(len(mb.data["tokens"])  # the rows this rank holds, padding included
                   for p in range(n) for mb in build_microbatches(samples, s, p, tp_size=tp, sequence_parallel=True))

    assert most_rows(schedule(lengths, n_ranks=n, max_seqlen_per_rank=m)) > m
    assert most_rows(schedule(lengths, n_ranks=n, max_seqlen_per_rank=m, padding=SequencePadding(tp=tp))) <= m


def test_a_sequence_sized_by_its_padded_length():
    pad = SequencePadding(tp=8)
    for algorithm in ("balanced", "dp-balanced"):  # 4096 tokens padded at one rank: two ranks
        s = schedule([4090, 10], n_ranks=2, max_seqlen_per_rank=4092, algorithm=algorithm, padding=pad)
        assert s.cp_size_of()[0] == 2 and not check_schedule(s)
    assert schedule([4090, 10], n_ranks=2, max_seqlen_per_rank=4092, algorithm="dp-balanced").cp_size_of()[0] == 1
    with pytest.raises(SequenceTooLongError, match=r"4 tokens, 64 once padded .* max_seqlen_per_rank to >= 16"):
        schedule([4], n_ranks=4, max_seqlen_per_rank=4, padding=SequencePadding(tp=8))


def test_refusals_name_the_value_and_the_fix():
    with pytest.raises(PaddingError, match=r"tp must be a positive int, got 0"):
        SequencePadding(tp=0)
    with pytest.raises(PaddingError, match=r"domain must be a positive int, got True"):
        SequencePadding(domain=True)
    with pytest.raises(PlanInputError, match=r"'megatron-dev' schedules lengths as given.*pad the lengths"):
        schedule([100, 50], n_ranks=2, max_seqlen_per_rank=64, algorithm="megatron-dev", padding=SequencePadding())
    with pytest.raises(PlanInputError, match=r"padding must be a harness.plan.SequencePadding .* got 8"):
        schedule([100, 50], n_ranks=2, max_seqlen_per_rank=64, padding=8)
    with pytest.raises(PaddingError, match=r"multiple of 2 x tp \(16\)"):
        SequencePadding(tp=8).cp_min(9, 8)


def test_the_refit_merges_an_overfull_block_with_partners_of_its_width():
    pad, cost = SequencePadding(tp=4), CostModel.megatron()
    its = [Item(g, by_hand(L, 1, 4), 1, cost, raw=L) for g, L in enumerate([19, 34, 17, 1, 1, 5, 5, 5, 40])]
    fit = PaddingFit(its, n=8, capacity=48, padding=pad)
    row = [(2, [0, 1, 2]), (1, [8]), (1, [3]), (2, [5, 6]), (1, [4]), (1, [7])]  # 20 + 36 + 20 fit 2 x 48 unpadded
    (got,) = fit.rows([row])  # padded to 16: 32 + 48 + 32 > 96; the widest partner of its width joins it
    assert got == [(4, [0, 1, 2, 5, 6]), (1, [8]), (1, [3]), (1, [4]), (1, [7])]
    start = 0
    for size, gids in got:
        assert start % size == 0 and sum(by_hand(L, size, 4) for L in (its[g].raw for g in gids)) <= size * 48
        start += size
    short = PaddingFit(its, n=8, capacity=48, padding=pad)  # a row of 3 of its 8 ranks: no partner for the merge
    assert short.rows([[(2, [0, 1, 2]), (1, [5])]]) is None and "no partner of 2 ranks" in short.refused
    tiny = PaddingFit([Item(g, 4, 1, cost, raw=1) for g in range(40)], n=2, capacity=64, padding=pad)
    assert tiny.rows([[(2, list(range(40)))]]) is None and "40 sequences hold 640 tokens" in tiny.refused


def test_the_trainer_plans_thd_and_dcp_with_its_padding():
    lengths = [249, 249, 9, 9, 240, 17, 120, 120, 63, 63, 500, 31, 31, 31, 31, 900]
    cfg = LayoutConfig(n_ranks=4, max_seqlen_per_rank=256, static_cp=4, tp_padding=8)
    for layout in ("thd", "dcp"):
        s, padding, _ = plan(layout, lengths, cfg)
        assert s.padding == SequencePadding(tp=8) and not overfull(s, 8) and padding == "local"
    domain = LayoutConfig(n_ranks=4, max_seqlen_per_rank=256, static_cp=4, tp_padding=2, dcp_padding="domain")
    s = plan("dcp", lengths, domain)[0]
    assert s.padding == SequencePadding(tp=2, domain=4) and not overfull(s, 2, domain=4)
    upstream = plan("dcp", lengths, LayoutConfig(n_ranks=4, max_seqlen_per_rank=256, static_cp=4, tp_padding=8,
                                                 scheduler="megatron-dev"))[0]
    assert upstream.padding is None  # parity: upstream's caller pads


def test_padding_stays_out_of_schedules_without_it():
    s = schedule([300, 90, 60], n_ranks=4, max_seqlen_per_rank=200)
    assert s.padding is None and "padding" not in s.to_dict()
