"""The convergence checks' rules: strict per step for dense models; for MoE strict over the first
``MOE_EXACT_STEPS`` steps, for bf16 over the first ``BF16_EXACT_STEPS``, then a relative band on the late-window
mean (routing flips, rounding)."""

from __future__ import annotations

from harness.apps import converge
from harness.train.trainer import TrainConfig


def rows(curves):
    return {k: [{"step": i, "loss": v} for i, v in enumerate(c)] for k, c in curves.items()}


def verdicts(curves, model="tiny-gpt", dtype="float32"):
    cfg = TrainConfig(model=model, steps=len(curves["bshd"]), dtype=dtype)
    return {c["target"]: c["pass"] for c in converge.evaluate(rows(curves), cfg, 4, "cpu", use_golden=False)}


BASE = [5.0 - 0.01 * i for i in range(40)]


def test_dense_models_are_strict_at_every_step():
    late = BASE[:30] + [x + 2e-5 for x in BASE[30:]]
    v = verdicts({"bshd": BASE, "thd": BASE, "dcp": late})
    assert v == {"thd vs bshd: max |delta loss| <= 1e-05": True, "dcp vs bshd: max |delta loss| <= 1e-05": False}


def test_moe_allows_late_routing_divergence_but_not_early_or_large():
    late = BASE[:25] + [x + 3e-3 for x in BASE[25:]]           # flips after step 20, stays close
    early = BASE[:5] + [x + 3e-5 for x in BASE[5:]]            # deviates within the first 20 steps
    drift = BASE[:25] + [x * 1.05 for x in BASE[25:]]          # separates by 5%
    v = verdicts({"bshd": BASE, "thd": late, "dcp": early}, model="tiny-moe")
    assert v["thd vs bshd: max |delta loss| (first 20 steps) <= 1e-05"]
    assert v["thd vs bshd: last-10-step mean loss within 1% (MoE routing)"]
    assert not v["dcp vs bshd: max |delta loss| (first 20 steps) <= 1e-05"]
    assert not verdicts({"bshd": BASE, "thd": drift}, model="tiny-moe")["thd vs bshd: last-10-step mean loss within 1% (MoE routing)"]


def test_bf16_adds_a_mean_bound():
    base = BASE[:converge.BF16_EXACT_STEPS]
    noisy = [x + (1.5e-3 if i % 2 else 0.0) for i, x in enumerate(base)]  # max ok (2e-3), mean 7.5e-4 > 5e-4
    v = verdicts({"bshd": base, "thd": noisy}, dtype="bfloat16")
    assert v == {"thd vs bshd: max |delta loss| <= 0.002": True, "thd vs bshd: mean |delta loss| <= 0.0005": False}


def test_long_bf16_runs_allow_late_rounding_divergence_but_not_early_or_large():
    """bf16 trajectories separate with the steps: strict over the first 30, then the late-window band; an fp32 run
    of the same curves stays strict at every step."""
    long = [5.0 - 0.01 * i for i in range(100)]
    late = long[:40] + [x + (6e-3 if i % 3 else -4e-3) for i, x in enumerate(long[40:])]  # rounding-sized, after 30
    early = long[:3] + [x + 2.5e-3 for x in long[3:]]                                   # a bug from step 4 on
    drift = long[:40] + [x * 1.05 for x in long[40:]]                                   # separates by 5%
    v = verdicts({"bshd": long, "thd": late, "dcp": early}, dtype="bfloat16")
    assert v == {"thd vs bshd: max |delta loss| (first 30 steps) <= 0.002": True,
                 "thd vs bshd: mean |delta loss| (first 30 steps) <= 0.0005": True,
                 "thd vs bshd: last-10-step mean loss within 1% (bf16 rounding)": True,
                 "dcp vs bshd: max |delta loss| (first 30 steps) <= 0.002": False,
                 "dcp vs bshd: mean |delta loss| (first 30 steps) <= 0.0005": False,
                 "dcp vs bshd: last-10-step mean loss within 1% (bf16 rounding)": True}, v
    assert not verdicts({"bshd": long, "thd": drift}, dtype="bfloat16")[
        "thd vs bshd: last-10-step mean loss within 1% (bf16 rounding)"]
    assert verdicts({"bshd": long, "thd": late}) == {"thd vs bshd: max |delta loss| <= 1e-05": False}
    moe = verdicts({"bshd": long, "thd": late}, model="tiny-moe", dtype="bfloat16")  # MoE's shorter span wins
    assert set(moe) == {"thd vs bshd: max |delta loss| (first 20 steps) <= 0.002",
                        "thd vs bshd: mean |delta loss| (first 20 steps) <= 0.0005",
                        "thd vs bshd: last-10-step mean loss within 1% (MoE routing)"} and all(moe.values())


def test_the_case_id_names_a_non_default_corpus():
    """Runs on another length spec or corpus seed train on other data: they must not share a golden."""
    from dataclasses import replace

    from harness.apps import converge
    from harness.data.corpus import CorpusConfig
    from harness.train.trainer import TrainConfig

    base = TrainConfig(steps=50)
    assert converge.case_id(base, 4) == "converge__tiny_gpt__w4__fp32"
    spec = replace(base, corpus=CorpusConfig(lengths="lognormal:mean=160,sigma=1.2,min=16,max=512"))
    assert converge.case_id(spec, 4) == "converge__tiny_gpt__w4__lognormal-mean160-sigma1.2-min16-max512__fp32"
    seeded = replace(base, corpus=CorpusConfig(seed=3))
    assert converge.case_id(seeded, 4) == "converge__tiny_gpt__w4__seed3__fp32"
    ids = {converge.case_id(c, 4) for c in (base, spec, seeded, replace(spec, corpus=replace(spec.corpus, seed=3)))}
    assert len(ids) == 4


def test_a_non_finite_loss_fails_and_says_where():
    """Python's max() skips a NaN unless it comes first: a layout whose loss turns NaN after step 1 must still
    fail, naming the step, and so must a NaN in the reference."""
    nan, inf = float("nan"), float("inf")
    for bad, word in ((nan, "nan"), (inf, "inf")):
        late = BASE[:7] + [bad] + BASE[8:]
        checks = converge.evaluate(rows({"bshd": BASE, "thd": BASE, "dcp": late}), TrainConfig(steps=40), 4, "cpu")
        failed = [c["target"] for c in checks if not c["pass"]]
        assert failed == [f"dcp vs bshd: step 8: dcp loss is {word}"], failed
    ref = BASE[:2] + [nan] + BASE[3:]
    checks = converge.evaluate(rows({"bshd": ref, "thd": BASE}), TrainConfig(steps=40), 4, "cpu")
    assert [c["target"] for c in checks if not c["pass"]] == ["thd vs bshd: step 3: bshd loss is nan"]
    for model in ("tiny-moe", "tiny-gpt"):  # the MoE rule's late window too
        v = verdicts({"bshd": BASE, "thd": BASE[:35] + [nan] + BASE[36:]}, model=model)
        assert not all(v.values()) and any("step 36: thd loss is nan" in t for t in v), v


def test_curves_of_different_lengths_fail_instead_of_comparing_a_prefix():
    v = verdicts({"bshd": BASE, "thd": BASE[:30]})
    assert v == {"thd vs bshd: 30 steps against the reference's 40": False}
