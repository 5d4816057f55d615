"""The fault catalogue's own contract: complete entries, documented live seams, nothing left behind,
typed errors, and checks that can fail (each check fed a run that breaks it)."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from harness.faults import CHECKS, FAULTS, LAYERS, SEAMS, SeamError, UnknownFaultError, get, replaced, select
from harness.faults import checks as ck
from harness.faults.seam import resolve

LAYER_NAMES = {"plan", "reroute", "attention", "loss", "gradients", "optimizer", "groups", "pipeline", "model", "replay",
               "step-wise"}


def test_every_fault_is_complete():
    names = [f.name for f in FAULTS]
    assert len(names) == len(set(names)) and all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", n) for n in names)
    for f in FAULTS:
        assert f.layer in LAYERS and f.check in CHECKS and f.seam in SEAMS, f.name
        assert f.url.startswith("https://github.com/") and f.source and f.title, f.name
        re.compile(f.expect)
        resolve(f.seam)  # the seam exists and is a function
    assert {f.layer for f in FAULTS} == LAYER_NAMES  # every layer the catalogue promises has a fault


def test_unknown_names_are_one_typed_error_listing_the_catalogue():
    with pytest.raises(UnknownFaultError, match=r"unknown fault\(s\) 'nope', 'gone'; the catalogue has: rope-"):
        select(["stale-cp-group", "nope", "gone"])
    with pytest.raises(UnknownFaultError, match="unknown fault 'x'"):
        get("x")
    assert [f.name for f in select(["stale-cp-group", "rope-positions-per-rank"])] == [
        "rope-positions-per-rank", "stale-cp-group"]  # catalogue order
    assert len(select(None)) == len(select([])) == len(FAULTS)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_a_fault_is_active_only_inside_its_context(fault):
    module, attr, original = resolve(fault.seam)
    with fault.applied() as fn:
        assert getattr(module, attr) is fn is not original
        assert fn.__harness_fault__ == fault.name
    assert getattr(module, attr) is original


def test_the_seam_is_restored_when_the_run_raises_and_never_stacked():
    module, attr, original = resolve("harness.train.passes:labels_for")
    with pytest.raises(RuntimeError, match="boom"):
        with get("labels-rolled-after-split").applied():
            raise RuntimeError("boom")
    assert getattr(module, attr) is original
    with get("labels-rolled-after-split").applied():
        with pytest.raises(SeamError, match="already replaced by 'labels-rolled-after-split'"):
            with replaced("harness.train.passes:labels_for", lambda o: o):
                pass
    assert getattr(module, attr) is original
    with pytest.raises(SeamError, match="not a registered seam"):
        with replaced("harness.train.trainer:train", lambda o: o):
            pass


def test_no_fault_state_survives_a_run():
    """After every fault was applied (and its replacement called where that needs no world), every
    seam holds its original function again."""
    before = {s: resolve(s)[2] for s in SEAMS}
    for f in FAULTS:
        with f.applied():
            pass
    assert {s: resolve(s)[2] for s in SEAMS} == before


# ------------------------------------------------------------- each check can fail and can pass
def _ranks(world=2, grads=None, ce=None, digests=("a", "b")):
    ranks = []
    for r in range(world):
        seq = {"step": 0, "lengths": {0: 2, 1: 2}, "seq": [0, 1] if r == 0 else [0, 1], "pos": [r, r],
               "ce": list(ce[r]) if ce else [1.0, 2.0]}
        probes = {"sequences": [seq], "grads": {"w": np.array(grads[r] if grads else [1.0, 2.0])},
                  "clipped": {"w": np.array([0.5, 1.0])},
                  "grad_norms": [1.0, 0.5], "digests": list(digests)}
        ranks.append({"probes": {"bshd": probes, "dcp": copy.deepcopy(probes)},
                      "rows": {"bshd": [{"loss": 3.0}, {"loss": 2.5}], "dcp": [{"loss": 3.0}, {"loss": 2.5}]}})
    return ranks


@pytest.mark.parametrize("name", list(ck.TRAIN_CHECKS))
def test_train_checks_pass_on_equal_runs(name):
    ref = _ranks()
    assert ck.TRAIN_CHECKS[name](ref, copy.deepcopy(ref), "dcp") is None


def test_each_train_check_fires_on_its_deviation():
    ref = _ranks()
    got = copy.deepcopy(ref)
    got[1]["probes"]["dcp"]["sequences"][0]["seq"] = [0, 0]  # sequence 0 position 1 twice, sequence 1 once
    assert "sequence 0 (2 tokens) had 1 positions" in ck.token_accounting(ref, got, "dcp").message
    got = copy.deepcopy(ref)
    got[1]["probes"]["dcp"]["digests"][1] = "c"
    a = ck.replica_consistency(ref, got, "dcp")
    assert a.where == {"step": 2, "ranks": [1]}
    got = copy.deepcopy(ref)
    got[0]["probes"]["dcp"]["grads"]["w"] = np.array([1.0, 2.0 + 1e-3])
    a = ck.step1_gradients(ref, got, "dcp")
    assert a.where == {"step": 1, "rank": 0, "parameter": "w"} and 10 < a.margin < 100
    got = copy.deepcopy(ref)
    got[1]["probes"]["dcp"]["clipped"]["w"] = np.array([0.5, 1.0 + 1e-3])
    a = ck.clipped_gradients(ref, got, "dcp")
    assert a.check == "clipped-gradients" and a.where == {"step": 1, "rank": 1, "parameter": "w"}
    got = copy.deepcopy(ref)
    got[1]["probes"]["dcp"]["sequences"][0]["ce"][1] = 2.0 + 1e-3
    a = ck.token_loss(ref, got, "dcp")
    assert a.where["sequence"] == 1 and a.margin > 10
    got = copy.deepcopy(ref)
    got[0]["probes"]["dcp"]["grad_norms"][1] = 0.5 * (1 + 2e-5)
    assert ck.grad_norm(ref, got, "dcp").where == {"step": 2}
    got = copy.deepcopy(ref)
    got[0]["rows"]["dcp"][0]["loss"] = 3.0 + 2e-5
    a = ck.loss_curve(ref, got, "dcp")
    assert a.where == {"step": 1} and abs(a.margin - 2.0) < 1e-6


def test_a_clean_run_that_died_is_reported_as_an_error_not_as_no_alarm():
    from harness.report.faults_report import clean_text, console

    died = {"alarms": [], "error": "rank 2: LayoutError: the longest sequence needs 4 ranks", "seconds": 0.0}
    result = {"faults": [], "clean": {"train-hybrid": died, "plan": {"alarms": [], "error": None, "seconds": 0.1}},
              "caught": 0, "total": 0, "seconds": 1.0}
    assert clean_text(died) == "ERROR: rank 2: LayoutError: the longest sequence needs 4 ranks"
    assert "train-hybrid: ERROR: rank 2" in console(result) and "plan: no alarm" in console(result)


def test_within_tolerance_is_no_alarm():
    ref = _ranks()
    got = copy.deepcopy(ref)
    got[0]["probes"]["dcp"]["grads"]["w"] = np.array([1.0, 2.0 + 1e-6])
    got[0]["rows"]["dcp"][0]["loss"] = 3.0 + 5e-6
    assert ck.step1_gradients(ref, got, "dcp") is None and ck.loss_curve(ref, got, "dcp") is None


def test_padding_chunk_rows_are_the_rank_chunks_that_hold_only_padding():
    """``te-padding-chunk-grads`` strikes exactly the rows of a rank's zig-zag chunks that start at or after the
    sequence's real tokens: 42 real tokens padded to 48 at CP 4 (chunks of 6) leave rank 0's second chunk (tokens
    42-47) padding only; 64 tokens leave none; at CP 2 a 5-token sequence (padded to 8, chunks of 2) leaves rank 0's
    second chunk (tokens 6-7) and nothing of rank 1's (its chunks 2-5 hold tokens 2-5)."""
    from types import SimpleNamespace

    from harness.faults.model_faults import padding_chunk_rows

    def mb(lengths, padded, cp, rank):
        cu, cup = [0], [0]
        for n, p in zip(lengths, padded):
            cu.append(cu[-1] + n)
            cup.append(cup[-1] + p)
        return SimpleNamespace(local_cp_size=cp, cp_rank=rank, cu_seqlens=cu, cu_seqlens_padded=cup)

    # rank 0 of CP 4 holds chunks 0 and 7 of each sequence: local rows [0, 6) and [6, 12) of the first sequence
    assert padding_chunk_rows(mb([42, 64], [48, 64], 4, 0)).tolist() == list(range(6, 12))
    assert padding_chunk_rows(mb([64], [64], 4, 0)).size == 0
    for r in (1, 2, 3):  # chunks r and 7 - r of a 42-token sequence all start before token 42
        assert padding_chunk_rows(mb([42], [48], 4, r)).size == 0
    assert padding_chunk_rows(mb([5], [8], 2, 0)).tolist() == [2, 3]
    assert padding_chunk_rows(mb([5], [8], 2, 1)).size == 0
    # the second sequence's rows start at its padded offset / cp: 16 / 2 = 8
    assert padding_chunk_rows(mb([13, 5], [16, 8], 2, 0)).tolist() == [10, 11]


@pytest.mark.parametrize("step", [float("nan"), float("inf")])
def test_prediction_agreement_fires_on_a_non_finite_step(monkeypatch, step):
    """The plan scenario's prediction check compares with ``<=``: a NaN or infinite simulated step is an alarm, not a
    silent pass."""
    from types import SimpleNamespace

    from harness.faults import scenarios

    monkeypatch.setattr(scenarios, "simulate", lambda s: SimpleNamespace(step_time=step))
    (alarm,) = scenarios._prediction_alarm(None)
    assert alarm.check == "prediction-agreement" and "balanced predicts" in alarm.message
