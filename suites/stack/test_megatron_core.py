"""``dcp-harness verify megatron-core`` where it cannot run: one line naming what to install or pass, exit 2,
before any rank starts; the stack's options are checked by name. The stack itself runs on GPUs (megatron-core
0.19 + TransformerEngine; ``reports/recorded/verify_megatron_core.h200x4.log``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.stack.megatron_core import WORKAROUNDS, _workarounds, preflight
from harness.stack.protocol import StackError

ROOT = Path(__file__).resolve().parents[2]


def test_verify_megatron_core_names_what_is_missing_in_one_line():
    r = subprocess.run([sys.executable, "-m", "harness", "verify", "megatron-core", "--world", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "megatron-core" in lines[0] and ("pip install" in lines[0] or "--device cuda" in lines[0]), lines[0]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the Python-version line is for Python < 3.12")
def test_old_python_is_named_with_its_version():
    with pytest.raises(StackError, match=r"Python >= 3.12; this is Python 3\.\d+"):
        preflight("cuda", 2)


def test_workarounds_are_checked_by_name():
    assert _workarounds(None) == () and _workarounds("none") == ()
    assert _workarounds("all") == tuple(WORKAROUNDS)
    assert _workarounds("rope-cp-group") == ("rope-cp-group",)
    with pytest.raises(StackError, match="unknown megatron-core workaround 'rope'"):
        _workarounds("rope")
