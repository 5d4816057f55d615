"""Value types of the command line's options, and its one-line usage errors.

Every option that sizes an allocation, a loop or a wait is parsed by one of these (argparse ``type=``):
the text becomes a value, or ``argparse.ArgumentTypeError`` with one sentence naming the value, the
limit and why. ``Parser.error`` prints any usage error as a single line, ``<prog>: error: <message>``,
and exits 2 (the command line's code for bad input); checks that need more than one option or the
machine raise ``UsageError``, which ``harness.cli.main`` prints the same way.

>>> RANKS("65536")
65536
>>> RANKS("1099511627776")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: 1099511627776 exceeds the limit 65536 (the schedulers keep state per rank; the largest dynamic-CP deployments have ~12k GPUs)
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from harness.data.corpus import MAX_BATCH_SEQUENCES, MAX_SEED
from harness.io import writable_folder as io_writable_folder
from harness.plan.limits import MAX_LENGTH, MAX_RANKS, MAX_SEQUENCES, WHY_LENGTH, WHY_RANKS, WHY_SEQUENCES

MAX_STEPS = 100_000
MAX_REPEATS = 100_000
MAX_WORLD = 1024
MAX_VPP = 1024
MAX_MICROBATCHES = 1024
MAX_BATCHES = 1000
MAX_ROWS = 10_000
MIN_STALL_S, MAX_STALL_S = 1.0, 86_400.0
MAX_RUN_SEQUENCES = 1 << 24
"""Steps x sequences per batch of a training run: every step's batch is drawn and planned before launch."""
MAX_PACK_TOKENS = 1 << 20
"""Tokens of one micro-batch on one device (``bench microbatch --shapes``)."""
CPU_RANKS_PER_CORE, MIN_CPU_RANKS = 4, 8
"""CPU ranks are torch processes on this machine: at most this many per core (and at least this many)."""


class UsageError(ValueError):
    """Options that are fine one by one but not together, or not on this machine (exit 2)."""


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line naming the fix (no usage block); the
    subcommands' parsers are of this class too."""

    def error(self, message: str):
        hint = "" if message.startswith("argument ") else f"; see {self.prog} --help"
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}{hint}\n")


def _show(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _bounded(convert: Callable[[str], float], kind: str, lo, hi, low: str, high: str, fmt: str) -> Callable:
    """A parser of ``convert(text)`` (``kind``: the type's name in errors) from ``lo`` to ``hi``; NaN and inf are
    refused; ``low`` / ``high`` say why smaller / larger values are."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:  # also more digits than Python converts
            raise argparse.ArgumentTypeError(f"{_show(text)} is not {kind}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text.strip()} is not a finite number")
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value:{fmt}} is below the minimum {lo:{fmt}} ({low})")
        if value > hi:
            raise argparse.ArgumentTypeError(f"{value:{fmt}} exceeds the limit {hi:{fmt}} ({high})")
        return value

    parse.__name__ = convert.__name__
    return parse


def integer(lo: int, hi: int, low: str, high: str) -> Callable[[str], int]:
    """An int from ``lo`` to ``hi``; ``low`` and ``high`` say why smaller and larger ones are refused."""
    return _bounded(lambda text: int(text, 10), "an integer", lo, hi, low, high, "d")


def real(lo: float, hi: float, low: str, high: str) -> Callable[[str], float]:
    """A finite float from ``lo`` to ``hi`` (``low`` / ``high``: why smaller / larger ones are refused)."""
    return _bounded(float, "a number", lo, hi, low, high, "g")


SEED = integer(0, MAX_SEED, "a seed is a non-negative integer", "numpy seeds here are 32-bit unsigned integers")
SEQUENCES = integer(1, MAX_SEQUENCES, "a global batch needs a sequence", WHY_SEQUENCES)
RANKS = integer(1, MAX_RANKS, "a domain needs a rank", WHY_RANKS)
MIN_CP = integer(1, MAX_RANKS, "a CP block has at least one rank", WHY_RANKS)
TOKENS = integer(1, MAX_LENGTH, "a rank must hold at least one token", WHY_LENGTH)
LENGTH = integer(1, MAX_LENGTH, "a sequence has at least one token", WHY_LENGTH)
VPP = integer(1, MAX_VPP, "1 means no constraint", "the micro-batch group of a pipeline is about its depth: tens")
ROWS = integer(0, MAX_ROWS, "a number of micro-batches to print", "a terminal line each; --json writes the whole schedule")
STEPS = integer(1, MAX_STEPS, "a run needs a step", "one run's steps; 100000 CPU steps take days")
BATCHES = integer(1, MAX_BATCHES, "a benchmark needs a batch", "each batch schedules every configuration again")
BATCH_SIZE = integer(1, MAX_BATCH_SEQUENCES, "a global batch needs a sequence",
                     "every step draws each sequence's tokens on every rank")
WORLD = integer(1, MAX_WORLD, "a job needs a process", "torchrun starts every rank on this machine")
NODES = integer(1, 4096, "a job runs on at least one machine", "the node ranks of a job are counted in thousands at most")
NODE_RANK = integer(0, 4095, "node ranks start at 0", "the node ranks of a job are counted in thousands at most")
STAGES = integer(1, MAX_WORLD, "1 means no pipeline", f"stages divide the world of at most {MAX_WORLD} ranks")
TP = integer(1, MAX_WORLD, "1 means no tensor parallelism", "TP ranks divide the world and each block's heads and FFN")
CHUNKS = integer(1, MAX_VPP, "1 means no interleaving", "virtual chunks split the model's layers: a few per stage")
STATIC_CP = integer(0, MAX_WORLD, "0 means the world size", f"a CP group of at most {MAX_WORLD} ranks")
MICROBATCHES = integer(1, MAX_MICROBATCHES, "a step needs a micro-batch", "the benchmark holds every step's batch")
REPEATS = integer(1, MAX_REPEATS, "a measurement needs a repetition", "repetitions run one after another; more only lengthen the run")
REPEATS0 = integer(0, MAX_REPEATS, "0 means none", "repetitions run one after another; more only lengthen the run")
SAMPLE = integer(1, MAX_SEQUENCES, "a sample needs a length", "--wikipedia draws from the whole sample")
TOKEN_COUNT_BUCKET = integer(0, MAX_LENGTH, "0 turns it off", WHY_LENGTH)


def TOKEN_BUCKET(text: str) -> int | str:  # noqa: N802 - a type like the others here
    """``auto`` or a number of tokens from 0 (off) to ``MAX_LENGTH`` (``TOKEN_COUNT_BUCKET``)."""
    if text == "auto":
        return "auto"
    try:
        int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_show(text)} is not auto or an integer") from None
    return TOKEN_COUNT_BUCKET(text)
STALL_S = real(MIN_STALL_S, MAX_STALL_S, "ranks report progress at most every 0.5 s, so less fails healthy jobs",
               "a day; the collectives time out at twice this")
VOCAB_MULTIPLE = integer(1, 1 << 16, "1 is the least multiple (padding only where tp does not divide the vocabulary)",
                         "a multiple past 65536 would pad a vocabulary many times over")
LOSS_CHUNK = integer(0, 1 << 24, "0 computes the whole logits at once",
                     "a chunk past 16M tokens is larger than any micro-batch: use 0")
AUX_COEF = real(0.0, 1e3, "0 turns it off", "a balance loss this strong drowns the language-modelling loss")
FLOPS_PER_BYTE = real(0.0, 1e12, "a price is not negative", "1e12 FLOPs per byte prices K/V exchange out entirely")


def shapes(text: str) -> str:
    """``bench microbatch --shapes``: each well-formed ``KxL`` within ``MAX_PACK_TOKENS`` (a malformed one is
    left to ``harness.bench.microbatch.parse_shape``, which names the form)."""
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", item)
        if not m:
            continue
        try:
            tokens = int(m.group(1)) * int(m.group(2))
        except ValueError:  # more digits than Python converts: certainly too many
            tokens = MAX_PACK_TOKENS + 1
        if tokens > MAX_PACK_TOKENS:
            raise argparse.ArgumentTypeError(f"shape {_show(item.strip())} is {tokens if tokens < 1 << 64 else 'too many'}"
                                             f" tokens, over the limit {MAX_PACK_TOKENS} (one micro-batch on one "
                                             f"device; the defaults are at most 2048)")
    return text


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_rank_limit() -> int:
    """CPU ranks this machine takes: ``CPU_RANKS_PER_CORE`` per core, at least ``MIN_CPU_RANKS``."""
    return max(MIN_CPU_RANKS, CPU_RANKS_PER_CORE * cpu_cores())


def check_cpu_ranks(n: int, flag: str) -> None:
    """``UsageError`` when ``n`` CPU ranks (torch processes) are more than this machine takes."""
    limit = cpu_rank_limit()
    if n > limit:
        raise UsageError(f"{flag} {n}: {n} CPU ranks exceed this machine's limit of {limit} (each is a torch process; "
                         f"{CPU_RANKS_PER_CORE} per core on {cpu_cores()} cores, at least {MIN_CPU_RANKS}); use "
                         f"{flag} {limit} or fewer, or GPUs")


def check_run_size(steps: int, batch: int) -> None:
    """``UsageError`` when a training run draws and plans more than ``MAX_RUN_SEQUENCES`` sequences."""
    if steps * batch > MAX_RUN_SEQUENCES:
        raise UsageError(f"--steps {steps} x --batch-size {batch} = {steps * batch} sequences exceeds the limit "
                         f"{MAX_RUN_SEQUENCES} (every step's batch is drawn and planned before the ranks start); use "
                         f"at most {MAX_RUN_SEQUENCES // batch} steps at this batch size")


def writable_folder(path: Path, flag: str) -> Path:
    """``harness.io.writable_folder`` for the option ``flag``."""
    return io_writable_folder(path, flag)
