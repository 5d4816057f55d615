"""Atomic file output: write to a temporary file in the same folder, fsync, then rename.

JSON files are strict JSON (RFC 8259): a NaN or an infinity - a diverged loss, a check's value where there was
nothing to compare - is written as ``null``, as JavaScript's ``JSON.stringify`` writes it, because Python's
``NaN`` / ``Infinity`` literals are refused by strict parsers (``JSON.parse``, jq, Go, Rust's serde). Readers of
the harness's own files take ``null`` where a number belongs as not a number. Files that only the harness's own
processes exchange (a job's result from its ranks) keep Python's literals: ``strict=False``."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


class OutputPathError(ValueError):
    """An output path that cannot be written (names the path and why)."""


def writable(path: str | Path) -> Path:
    """``path`` if a file can be written there (its folder exists or can be made, and is writable),
    checked before a long job starts; else ``OutputPathError``."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{path} is a directory; give a file path")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"cannot create the folder of {path}: {e.strerror or e}") from None
    try:  # a real probe: os.access says yes to root even where the file system refuses
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputPathError(f"cannot write {path}: {e.strerror or e} in {folder}") from None
    return path


def writable_folder(path: str | Path, what: str, how: str = "") -> Path:
    """``path`` if it is a folder, or can be made one, that files can be written in; else ``OutputPathError``
    naming ``what`` (``--out``, ``nightly root``) and the fix (``how`` ends it: `` with --root``). Nothing is
    created: the nearest existing folder is probed with a real file (``os.access`` says yes to root even
    where the file system refuses)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{what} {path} is a file, not a folder; give a folder{how}")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputPathError(f"{what} {path} cannot be made: {probe} is a file; give a folder{how}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".dcp-harness-", suffix=".probe", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise OutputPathError(f"{what} {path} cannot be written ({e.strerror or e} in {probe}); give a writable "
                              f"folder{how}") from None
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temporary_folder(prefix: str, parent: str | Path) -> Path:
    """A new folder in ``parent`` for output assembled there and renamed when complete, with the
    umask's mode (``tempfile.mkdtemp`` makes 0700, which a web server serving a report cannot read)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o777 & ~_umask())
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace ``path`` with ``data`` so that readers see the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a report must be readable like any file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def json_ready(obj: Any) -> Any:
    """``obj`` with every float that JSON cannot hold (NaN, +-inf) replaced by None, through dicts, lists and tuples
    (a tuple becomes a list, as ``json`` writes it)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def strict_json(obj: Any, **kw) -> str:
    """``json.dumps`` of ``obj`` as strict JSON: NaN and infinities as ``null`` (``json_ready``)."""
    return json.dumps(json_ready(obj), allow_nan=False, **kw)


def atomic_write_json(path: str | Path, obj: Any, *, strict: bool = True) -> Path:
    """``obj`` as JSON at ``path``, atomically; ``strict`` (default): NaN and infinities as ``null``."""
    text = strict_json(obj, indent=1) if strict else json.dumps(obj, indent=1)
    return atomic_write_text(path, text + "\n")


def read_report(path: str | Path, benchmarks: tuple[str, ...], error: type[Exception], what: str) -> dict:
    """The JSON report at ``path`` whose ``benchmark`` is one of ``benchmarks``, with a ``results`` object; anything
    else (unreadable, not JSON, another report) is ``error`` naming the file and ``what`` it should be."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise error(f"cannot read {p}: {e}") from None
    kind = doc.get("benchmark") if isinstance(doc, dict) else None
    if kind not in benchmarks or not isinstance(doc.get("results"), dict):
        raise error(f"{p} is not {what} (its 'benchmark' is {kind!r})")
    return doc
