"""Sequence-length workloads: named distributions, the Wikipedia sample, length files.

Spec strings (``sample(spec, n, seed)``):

- ``lognormal:mean=1024,sigma=1.5,min=128,max=8192`` - Megatron's mock SFT data:
  ``mu = ln(mean) - sigma**2 / 2``, lognormal, rounded and clipped to ``[min, max]`` (``min`` defaults
  to 1, ``max`` to ``MAX_LENGTH``); ``0 <= sigma <= MAX_SIGMA``.
- ``uniform:min=128,max=8192`` - integers, both ends included.
- ``const:value=4096``.
- ``wikipedia:max=32768`` - draws (with replacement) from the committed seeded sample of real
  Wikipedia document lengths (``fixtures/lengths/wikipedia_sample.txt.gz``), clipped to ``max``.
- ``file:PATH`` - the first ``n`` lengths of a text file (one int per line, ``#`` comments,
  ``.gz`` allowed); ``n=None`` takes all.

Every distribution also takes ``multiple=K`` (round each length up to a multiple of K, e.g. the
``2 * dp * cp`` THD padding divisor). Same spec, n and seed -> same lengths, on every machine.

Parameters are finite numbers; ``min``, ``max``, ``value`` and ``multiple`` whole numbers of tokens from 1
to ``MAX_LENGTH`` (``harness.plan.limits``), ``mean`` in ``(0, MAX_LENGTH]``, ``min <= max``. ``n`` is at
most ``MAX_SEQUENCES``, a seed a non-negative int; anything else is a ``PlanInputError`` naming it.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np

from harness.io import atomic_write_bytes
from harness.paths import ROOT
from harness.plan.errors import PlanInputError, SizeLimitError
from harness.plan.limits import MAX_LENGTH, MAX_SEQUENCES, WHY_LENGTH, WHY_SEQUENCES

FIXTURES = ROOT / "fixtures"
WIKIPEDIA_SAMPLE = FIXTURES / "lengths" / "wikipedia_sample.txt.gz"

_PARAMS = {
    "lognormal": {"mean", "sigma", "min", "max"},
    "uniform": {"min", "max"},
    "const": {"value"},
    "wikipedia": {"max"},
}
_WHOLE = {"min", "max", "value", "multiple"}
_DEFAULT_RANGE = {"lognormal": (1, MAX_LENGTH), "uniform": (1, 8192), "const": (1, MAX_LENGTH),
                  "wikipedia": (1, MAX_LENGTH)}
MAX_SIGMA = 8.0
"""Beyond it ``mu = ln(mean) - sigma**2 / 2`` puts nearly every draw at ``min`` or ``max``."""
MAX_SOURCE_LENGTHS = 1 << 26
"""Lengths read from the source of ``make_wikipedia_sample`` (English Wikipedia has ~7M documents)."""


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``"lognormal:mean=1024,sigma=1.5"`` -> ``("lognormal", {"mean": 1024.0, "sigma": 1.5})``."""
    kind, _, rest = spec.partition(":")
    if kind == "file":
        return kind, {"path": rest}
    if kind not in _PARAMS:
        raise PlanInputError(f"unknown length distribution {kind!r} in {spec!r}; use one of "
                             f"{', '.join(sorted(_PARAMS))} or file:PATH")
    params: dict[str, float] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in _PARAMS[kind] | {"multiple"}:
            raise PlanInputError(f"bad parameter {item!r} in {spec!r}; {kind} takes "
                                 f"{', '.join(sorted(_PARAMS[kind] | {'multiple'}))} as key=value")
        if key in params:
            raise PlanInputError(f"parameter {key} appears twice in {spec!r}; give it once")
        try:
            params[key] = float(value)
        except ValueError:
            raise PlanInputError(f"parameter {key}={value!r} in {spec!r} is not a number") from None
    missing = {"mean", "sigma"} - set(params) if kind == "lognormal" else set()
    missing |= {"value"} - set(params) if kind == "const" else set()
    if missing:
        raise PlanInputError(f"{spec!r} needs {', '.join(sorted(missing))}")
    _check_params(kind, params, spec)
    return kind, params


def _num(v: float) -> str:
    v = float(v)
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:.15g}"


def _check_params(kind: str, params: dict[str, float], spec: str) -> None:
    """Finite, whole where a token count, in range (see the module doc); ``PlanInputError`` naming the parameter."""
    for key, v in params.items():
        if not math.isfinite(v):
            raise PlanInputError(f"parameter {key}={_num(v)} in {spec!r} must be a finite number")
        if key in _WHOLE and not v.is_integer():
            raise PlanInputError(f"parameter {key}={_num(v)} in {spec!r} must be a whole number of tokens")
        if key in _WHOLE and not 1 <= v <= MAX_LENGTH:
            raise PlanInputError(f"parameter {key}={_num(v)} in {spec!r} must be from 1 to {MAX_LENGTH} ({WHY_LENGTH})")
    if kind == "lognormal":
        mean, sigma = params["mean"], params["sigma"]
        if not 0 < mean <= MAX_LENGTH:
            raise PlanInputError(f"parameter mean={_num(mean)} in {spec!r} must be > 0 and <= {MAX_LENGTH} "
                                 f"({WHY_LENGTH})")
        if sigma < 0:
            raise PlanInputError(f"parameter sigma={_num(sigma)} in {spec!r} must be >= 0 (a spread is not negative)")
        if sigma > MAX_SIGMA:
            raise PlanInputError(f"parameter sigma={_num(sigma)} in {spec!r} exceeds the limit {MAX_SIGMA:g} (a larger "
                                 f"spread puts nearly every length at min or max)")
    lo, hi = params.get("min", _DEFAULT_RANGE[kind][0]), params.get("max", _DEFAULT_RANGE[kind][1])
    if lo > hi:
        raise PlanInputError(f"{spec!r} needs 1 <= min <= max, got min={_num(lo)}, max={_num(hi)}"
                             + ("" if "max" in params else " (the default)"))


def read_lengths(path: str | Path, limit: int = MAX_SEQUENCES, why: str = WHY_SEQUENCES, *,
                 first: int | None = None) -> list[int]:
    """Integers, one per line, from a text file (``.gz`` allowed); ``#`` starts a comment. ``first``: only
    the first that many; otherwise a file of more than ``limit`` lengths is refused (``why`` says why)."""
    p = Path(path)
    if p.is_dir():
        raise PlanInputError(f"length file {str(p)!r} is a directory; give a text file of lengths, one per line")
    if not p.exists():
        raise PlanInputError(f"length file {str(p)!r} does not exist")
    opener = gzip.open if p.suffix == ".gz" else open
    out = []
    try:
        with opener(p, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                text = line.split("#", 1)[0].strip()
                if not text:
                    continue
                try:
                    out.append(int(text))
                except ValueError:
                    raise PlanInputError(f"{p}:{i}: {text[:40]!r} is not an integer length") from None
                if len(out) == first:
                    break
                if len(out) > limit:
                    raise SizeLimitError(f"length file {str(p)!r} holds more than {limit} lengths, the limit "
                                         f"({why}); give at most {limit}")
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as e:
        raise PlanInputError(f"length file {str(p)!r} is not a text file of lengths ({type(e).__name__}); give one "
                             f"integer per line (plain text, or gzip-compressed with a .gz name)") from None
    except OSError as e:
        raise PlanInputError(f"cannot read length file {str(p)!r}: {e.strerror or e}") from None
    if not out:
        raise PlanInputError(f"length file {str(p)!r} holds no lengths (only blank lines or comments); give one "
                             f"integer per line")
    return out


def _draw(kind: str, params: dict, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "lognormal":
        mean, sigma = params["mean"], params["sigma"]
        if mean <= 0 or sigma < 0:
            raise PlanInputError(f"lognormal needs mean > 0 and sigma >= 0, got mean={mean}, sigma={sigma}")
        x = np.rint(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, size=n))
        return np.clip(x, params.get("min", 1), params.get("max", MAX_LENGTH))
    if kind == "uniform":
        lo, hi = int(params.get("min", 1)), int(params.get("max", 8192))
        if not 1 <= lo <= hi:
            raise PlanInputError(f"uniform needs 1 <= min <= max, got min={lo}, max={hi}")
        return rng.integers(lo, hi + 1, size=n).astype(float)
    if kind == "const":
        return np.full(n, params["value"])
    pool = np.asarray(read_lengths(WIKIPEDIA_SAMPLE), dtype=float)
    return np.clip(rng.choice(pool, size=n, replace=True), 1, params.get("max", MAX_LENGTH))


def sample(spec: str, n: int | None, seed: int = 0) -> list[int]:
    """``n`` lengths from ``spec`` with a fixed ``seed`` (see module doc)."""
    kind, params = parse_spec(spec)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise PlanInputError(f"number of sequences must be an int >= 0, got {n!r}")
    if n is not None and n > MAX_SEQUENCES:
        raise SizeLimitError(f"{n} sequences exceed the limit {MAX_SEQUENCES} ({WHY_SEQUENCES})")
    if kind == "file":
        return [] if n == 0 else read_lengths(params["path"], first=n)
    if n is None:
        raise PlanInputError(f"{spec!r} draws lengths: give the number of sequences")
    _check_seed(seed)
    x = _draw(kind, params, n, np.random.default_rng(seed))
    mult = int(params.get("multiple", 1))
    if mult < 1:
        raise PlanInputError(f"multiple must be >= 1, got {mult}")
    x = np.maximum(x, 1).astype(np.int64)
    return (-(-x // mult) * mult).tolist()


def _check_seed(seed) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise PlanInputError(f"seed must be a non-negative int, got {seed!r}")


def make_wikipedia_sample(source: str | Path, n: int, seed: int, out: Path = WIKIPEDIA_SAMPLE) -> Path:
    """Write a seeded sample (without replacement) of ``source`` to ``out`` (atomically)."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SEQUENCES:
        raise PlanInputError(f"sample size {n!r} must be an int from 1 to {MAX_SEQUENCES} ({WHY_SEQUENCES})")
    _check_seed(seed)
    pool = np.asarray(read_lengths(source, MAX_SOURCE_LENGTHS, "a source of document lengths; English Wikipedia "
                                                              "has ~7M documents"), dtype=np.int64)
    if n > len(pool):
        raise PlanInputError(f"cannot sample {n} lengths without replacement from {Path(source).name}, which holds "
                             f"{len(pool)}; use --n {len(pool)} or fewer")
    picked = np.random.default_rng(seed).choice(pool, size=n, replace=False)
    header = (f"# {n} Wikipedia document lengths (tokens), sampled without replacement with seed {seed}\n"
              f"# from {Path(source).name} ({len(pool)} lengths; FlexSP / Hetu-Galvatron evaluation data)\n"
              f"# regenerate: dcp-harness fixtures wikipedia --source {Path(source).name} --n {n} --seed {seed}\n")
    body = header + "\n".join(str(int(v)) for v in picked) + "\n"
    atomic_write_bytes(out, gzip.compress(body.encode(), mtime=0))
    return out
