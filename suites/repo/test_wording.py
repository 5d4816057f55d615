"""The project speaks of the product: no work sessions and no tracker issue numbers of this project in
code, docs, reports or file names (a measurement is named by its date, commit and machine; upstream
references keep their ``#``, e.g. "Megatron-LM issue #5352")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIARY = re.compile(r"\bsessions?[ _-]?\d+|\bissues? \d+", re.IGNORECASE)


def _files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


def test_no_session_or_tracker_issue_wording_in_names_or_text():
    hits = []
    for f in _files():
        if DIARY.search(f):
            hits.append(f"{f}: file name")
        try:
            text = (ROOT / f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (images, gzip)
        hits += [f"{f}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in DIARY.finditer(text)]
    assert not hits, "\n".join(hits[:40])
