"""The token bucket: every rank's micro-batch padded to a multiple of a few tokens, and its ``auto`` default.

Every matrix multiply of a THD micro-batch has the rank's token count as one dimension. cuBLASLt picks a kernel
per shape through a heuristics cache of ~8K shapes; variable-length packs give ~1K token counts per rank times ~10
GEMM shapes a layer, so the cache thrashes for the whole run and each miss costs the host ~0.1-0.2 ms a GEMM
(``docs/upstream-findings.md``, ``docs/repro/cublaslt_shape_cache.py``). Padding each micro-batch to a multiple of
``AUTO_BUCKET`` tokens leaves at most ``max_seqlen_per_rank / AUTO_BUCKET`` counts. The padding is processed and
counted, never trained on. The measured step (``bench step``) and the verified step (``converge``, the nightly) take
the same default, so what is timed is what is proven.

>>> resolve("auto", "cuda", 2048), resolve("auto", "cuda", 1000), resolve("auto", "cpu", 2048), resolve(16, "cpu", 8)
(64, 0, 0, 16)
>>> resolve(7, "cuda", 2048)
Traceback (most recent call last):
...
ValueError: token_bucket must be 'auto', 0 (off) or an even int of tokens, got 7
"""

from __future__ import annotations

AUTO = "auto"

AUTO_BUCKET = 64
"""``token_bucket="auto"`` on CUDA. Side by side with unpadded twins on 2 x H200 (``reports/recorded/
token_bucket.h200x2.log``): the default workload's step 1.031x faster (static CP) and 1.038x (dynamic CP),
Megatron's batch 0.994-1.130x and 1.043-1.093x; padding 1.0-1.8% of the tokens. The padded verified step passes
the same bands as the unpadded one on 2 x H200 (``reports/recorded/converge_bucket.h200x2.log``)."""


def check(value) -> None:
    """``ValueError`` unless ``value`` is ``"auto"``, 0 or an even int >= 2."""
    if value == AUTO and isinstance(value, str):
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value % 2:
        raise ValueError(f"token_bucket must be 'auto', 0 (off) or an even int of tokens, got {value!r}")


def resolve(value, device: str, max_seqlen_per_rank: int) -> int:
    """The tokens each micro-batch is padded to a multiple of: ``value`` itself, or for ``auto`` ``AUTO_BUCKET`` on
    CUDA when it divides ``max_seqlen_per_rank`` (a full pack then stays full), else 0 (off; on the CPU there is no
    cuBLASLt cache to spare)."""
    check(value)
    if value == AUTO:
        return AUTO_BUCKET if device == "cuda" and max_seqlen_per_rank % AUTO_BUCKET == 0 else 0
    return value
