"""The parallel runtime's choices that a run's configuration names, and their checks, without torch.

A launching process (``dcp-harness converge`` and the other commands that start ranks) validates a
``harness.train.config.TrainConfig`` before any rank starts; these names let it do so without importing torch. The
modules that implement each choice re-export them: ``EXCHANGES`` (``harness.parallel.cp_attention``), ``OPTIMIZERS``
(``harness.parallel.dist_opt``), ``DEFAULT_BUCKET_ELEMENTS`` (``harness.parallel.grad_reduce``), ``kv_replicas``
(``harness.parallel.ulysses``), ``check_divisible`` (``harness.parallel.expert_parallel``), ``COMM_TYPES`` /
``comm_type`` / ``require_te`` (``harness.parallel.te_cp``),
``TensorParallelError`` / ``check_tp_model`` (``harness.parallel.tensor_parallel``), ``SequenceParallelError``
(``harness.parallel.sequence_parallel``).
"""

from __future__ import annotations

import importlib.util
import math

from harness.plan.errors import LayoutError, PlanInputError

EXCHANGES = ("gather", "ring", "a2a", "auto")
"""The harness's own K/V exchanges of CP blocks (``harness.parallel.cp_attention``)."""

OPTIMIZERS = ("replicated", "distributed")
"""How a run keeps its optimiser: every rank the whole AdamW, or each rank 1/N of it (``harness.parallel.dist_opt``)."""

DEFAULT_BUCKET_ELEMENTS = 40_000_000
"""Megatron's default DDP bucket size (elements; 160 MB of fp32)."""

COMM_TYPES = ("p2p", "all_gather", "a2a")
"""TE's CP communication types the harness drives in THD (``te:<type>`` exchanges, ``harness.parallel.te_cp``)."""
INSTALL = 'pip install "transformer-engine[pytorch]==2.20.2"'


class TensorParallelError(LayoutError):
    """Tensor parallelism cannot run this model or configuration (names the values and the fix)."""


class SequenceParallelError(TensorParallelError):
    """Sequence parallelism cannot split this run's token rows or run this configuration (names the values and the
    fix)."""


class HeadSplitError(ValueError):
    """The block's heads do not split over its ranks (the all-to-all exchange cannot run)."""


class ExpertParallelError(LayoutError):
    """Expert parallelism cannot run this model on this domain (names the values and the fix)."""


class TEUnavailableError(PlanInputError):
    """TransformerEngine is not installed, or there is no CUDA device for it."""


def kv_replicas(heads: int, kv_heads: int, cp_size: int) -> int:
    """How many ranks each K/V head is sent to (1: the K/V heads split as they are); raises
    ``HeadSplitError`` when the heads cannot be split over ``cp_size`` ranks."""
    if heads % cp_size:
        raise HeadSplitError(f"the a2a CP exchange splits heads over the block's ranks: heads={heads} is not a "
                             f"multiple of cp_size={cp_size}; use exchange='gather' (or 'ring') for this model")
    if kv_heads % cp_size == 0:
        return 1
    # cp | heads = (heads / kv_heads) kv_heads, so r = cp / gcd(kv_heads, cp) divides heads / kv_heads: each copy
    # of a K/V head serves whole query heads of one rank
    return cp_size // math.gcd(kv_heads, cp_size)


def check_divisible(num_experts: int, domain: int, model: str = "the model") -> None:
    if num_experts < 1 or domain < 1 or num_experts % domain:
        raise ExpertParallelError(
            f"expert parallelism shards {model}'s {num_experts} experts over the {domain}-rank DP x CP domain: "
            f"{num_experts} is not a multiple of {domain}; use a domain whose size divides {num_experts} (world / pp), "
            f"a model with a multiple of {domain} experts, or turn expert parallelism off")


def require_te(device) -> None:
    """Raise ``TEUnavailableError`` (one line: what to install or use) unless TE can run on ``device`` (a name such
    as ``"cuda"`` / ``"cuda:1"`` or a ``torch.device``)."""
    if importlib.util.find_spec("transformer_engine") is None:
        raise TEUnavailableError(f"--attention te needs TransformerEngine: {INSTALL} (on a CUDA machine; "
                                 "see the README's GPU section)")
    if str(getattr(device, "type", device)).split(":")[0] != "cuda":
        raise TEUnavailableError("--attention te runs on CUDA devices only; use --device cuda, or the harness's own "
                                 "CP attention on CPU")


def comm_type(exchange: str) -> str | None:
    """``p2p`` for ``te:p2p`` ...; None for the harness's own exchanges. Unknown TE types are an error."""
    if not exchange.startswith("te:"):
        return None
    kind = exchange[3:]
    if kind not in COMM_TYPES:
        raise LayoutError(f"unknown TransformerEngine CP communication type {kind!r}; choose te:"
                          f"{', te:'.join(COMM_TYPES)}")
    return kind


def check_tp_model(c, tp: int, name: str = "the model") -> None:
    """``TensorParallelError`` unless ``tp`` ranks can split ``c``'s blocks (a ``ModelConfig``)."""
    if tp == 1:
        return
    sizes = [("heads", c.heads), ("kv_heads", c.kv_heads), ("ffn", c.ffn)]  # the vocabulary is padded instead
    if "M" in c.kinds:  # an SSM mixer splits by heads
        sizes.append(("ssm_heads", c.ssm_heads))
    if c.vocab < tp:
        raise TensorParallelError(f"tensor parallelism splits the vocabulary over the TP ranks: {name}'s vocab="
                                  f"{c.vocab} is smaller than tp={tp}; use a tp of at most {c.vocab}")
    for what, n in sizes:
        if n % tp:
            raise TensorParallelError(f"tensor parallelism splits {what} over the TP ranks: {name}'s {what}={n} is not "
                                      f"a multiple of tp={tp}; use a tp dividing {n}")
