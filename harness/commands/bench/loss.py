"""``dcp-harness bench loss``: the LM head and its cross-entropy, whole against chunked."""

from __future__ import annotations

import argparse

from harness import cli_types as T
from harness.commands.common import add_out

NAME = "loss"
HELP = "the LM head and its loss, whole logits against chunks of tokens: time, peak memory (CUDA), agreement"
DESCRIPTION = None

_TOKENS = T.integer(1, 1 << 22, "a head needs a token", "4M tokens of logits do not fit one device")
_HIDDEN = T.integer(1, 1 << 16, "a head needs a hidden size", "hidden sizes stop at tens of thousands")
_VOCAB = T.integer(2, 1 << 20, "a cross-entropy needs two classes", "vocabularies stop at hundreds of thousands")
_ROUNDS = T.integer(1, 1000, "a median needs a round", "a thousand rounds of the head is hours")


def _chunks(text: str) -> tuple[int, ...]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("give one or more chunk sizes, comma-separated (0 = the whole logits), "
                                         "e.g. 0,4096,8192")
    return tuple(T.LOSS_CHUNK(x) for x in items)


def add_arguments(p) -> None:
    add_out(p, "bench_loss.json")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when a GPU is visible (bf16 autocast), else cpu (fp32)")
    p.add_argument("--tokens", type=_TOKENS, default=None, help="tokens (default 32768 on CUDA, 2048 on the CPU)")
    p.add_argument("--hidden", type=_HIDDEN, default=None, help="hidden size (default 4096 on CUDA, 128 on the CPU)")
    p.add_argument("--vocab", type=_VOCAB, default=None, help="vocabulary (default 128256 on CUDA, 16000 on the CPU)")
    p.add_argument("--chunks", type=_chunks, default=None,
                   help="chunk sizes, comma-separated, 0 = the whole logits (always run: the ratios' denominator); "
                        "default 0,2048,4096,8192 on CUDA, 0,256,512 on the CPU")
    p.add_argument("--rounds", type=_ROUNDS, default=5, help="alternated timed rounds (default 5)")


def run(a) -> int:
    import torch

    from harness.bench.loss import main

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise T.UsageError("--device cuda: no GPU is visible; use --device cpu")
    return main(out=a.out, device=device, tokens=a.tokens, hidden=a.hidden, vocab=a.vocab, chunks=a.chunks,
                rounds=a.rounds)
