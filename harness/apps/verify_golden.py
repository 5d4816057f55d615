"""Goldens of ``dcp-harness verify``: a stack's loss and gradient-norm curves, per hardware.

``golden/verify/<case_id>.<hw>.json`` keeps rank 0's loss and gradient norm of every step of every layout and of
the one-rank reference, from a run whose every check passed (``--update-golden`` refuses a FAIL run). A later run
of the same case (stack, its options, scheduler, world, corpus, precision: ``case_id``) on the same hardware
(``harness.apps.converge.hardware``: ``cpu``, ``h100``, ``h200`` ...) is held to it: losses within the precision's
loss tolerance (absolute), gradient norms within its gradient-norm tolerance (relative)
(``harness.stack.checks.tolerances``; the file's rule may only tighten them). The reference run without CP
drifts with the stack's versions as much as the layouts do: a golden is what catches a change that moves both.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness import golden as golden_mod
from harness.apps.converge import case_id as converge_case_id
from harness.data.corpus import CorpusConfig
from harness.finite import target, worst
from harness.stack.checks import tolerances
from harness.train.config import TrainConfig

GOLDEN_SUITE = "verify"
QUANTITIES = ("loss", "grad_norm")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", str(text).lower()).strip("-")


def case_id(stack: str, options: dict, cfg: TrainConfig, world: int) -> str:
    """``verify__<stack>[__<option>-<value>...][__<scheduler>]__<converge's case tail>``: the stack (its built-in
    name, or the file's stem or module and the factory: where the file lies is not), every option it was given and
    a non-default scheduler are part of the case; the step count is not (a golden of N steps serves every run of
    at most N)."""
    where, _, fn = stack.rpartition(":")
    if where:
        stack = f"{Path(where).stem if where.endswith('.py') else where}-{fn}"
    opts = "".join(f"__{_slug(k)}-{_slug(v)}" for k, v in sorted(options.items()))
    sched = "" if cfg.scheduler == "balanced" else f"__{_slug(cfg.scheduler)}"
    tail = converge_case_id(cfg, world).removeprefix("converge__")
    return f"verify__{_slug(stack)}{opts}{sched}__{tail}"


def update_command(stack: str, options: dict, cfg: TrainConfig, world: int) -> str:
    """The command that writes this case's golden (on the hardware it runs on)."""
    opts = "".join(f" --option {k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in sorted(options.items()))
    sched = "" if cfg.scheduler == "balanced" else f" --scheduler {cfg.scheduler}"
    c, d = cfg.corpus, CorpusConfig()
    corpus = "".join(f" {flag} {getattr(c, f)}" for flag, f in (("--lengths", "lengths"), ("--batch-size", "sequences_per_batch"),
                                                                 ("--seed", "seed"), ("--vocab", "vocab"))
                     if getattr(c, f) != getattr(d, f))
    return (f"dcp-harness verify {stack} --device {cfg.device} --world {world} --steps {cfg.steps} "
            f"--max-seqlen-per-rank {cfg.max_seqlen_per_rank}{corpus}{sched}{opts} --update-golden")


def series(reports: list) -> dict[str, list[float]]:
    """``{"loss": [...], "grad_norm": [...]}`` of one rank's step reports."""
    return {q: [float(getattr(r, q)) for r in reports] for q in QUANTITIES}


def write(path: Path, runs: dict[str, dict], cfg: TrainConfig, *, stack: str, stack_name: str, options: dict,
          world: int, hw: str, command: str) -> Path:
    """Write the golden of ``runs`` (``{layout or "reference": series(...)}``)."""
    tol = tolerances(cfg.dtype, cfg.model)
    data = {f"{name}.{q}": vals[q] for name, vals in runs.items() for q in QUANTITIES}
    return golden_mod.write(path, suite=GOLDEN_SUITE, case_id=path.name.rsplit(".", 2)[0], hw=hw,
                            config={**cfg.to_dict(), "stack": stack, "stack_name": stack_name, "options": options,
                                    "world": world},
                            data=data, rule={"kind": "approx", "atol": tol["loss"]["max"], "rtol": tol["grad_norm"]},
                            command=command)


def against(path: Path, runs: dict[str, dict], cfg: TrainConfig, hw: str, update_hint: str) -> list[dict]:
    """Check lines of ``runs`` against the golden at ``path`` (``GoldenError`` when it is missing or malformed):
    per run, the worst |delta loss| (the rule's ``atol``) and relative |delta gradient norm| (its ``rtol``)."""
    doc = golden_mod.load(path, update_hint)
    tol = tolerances(cfg.dtype, cfg.model)
    rule = golden_mod.checked_rule(doc["rule"], {"atol": tol["loss"]["max"], "rtol": tol["grad_norm"]}, path,
                                   update_hint)
    if rule["kind"] == "exact":
        rule = {"kind": "approx", "atol": 0.0, "rtol": 0.0}
    out = []
    for name, vals in runs.items():
        steps = len(vals["loss"])
        gl = golden_mod.checked_series(doc, f"{name}.loss", path, update_hint, steps)[:steps]
        gg = golden_mod.checked_series(doc, f"{name}.grad_norm", path, update_hint, steps)[:steps]
        dl = worst(abs(a - b) for a, b in zip(vals["loss"], gl))
        dg = worst(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(vals["grad_norm"], gg))
        out.append(target(f"{name} vs golden ({hw}): max |delta loss| <= {rule['atol']:g}", dl, rule["atol"]))
        out.append(target(f"{name} vs golden ({hw}): max relative |delta grad norm| <= {rule['rtol']:g}", dg,
                          rule["rtol"]))
    return out
