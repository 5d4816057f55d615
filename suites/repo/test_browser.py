"""Reports as a user opens them: a real headless browser renders the page (skipped where no
chromium is installed, e.g. CI's fresh machine; ``apt-get install chromium`` enables it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium on this machine")


def _render(page, tmp_path):
    dom = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    shot = tmp_path / "shot.png"
    subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1400,1200", page.as_uri()], capture_output=True, timeout=120)
    return dom.stdout, shot


def test_the_fault_report_renders_its_table_and_links(tmp_path):
    from harness.faults.run import run_catalogue, write

    result = run_catalogue(["stepwise-cumsum-interleaved", "pr2000-inverted-empty-slot-assert"],
                           progress=lambda s: None)
    page = tmp_path / "faults.html"
    write(result, tmp_path / "faults.json", page)
    dom, shot = _render(page, tmp_path)
    assert "faults caught: 2/2" in dom and dom.count("<tr") >= 2 + 1 + 2 + 1 + 11 + 1
    assert 'href="https://github.com/NovaSky-AI/SkyRL/pull/1281"' in dom
    assert shot.stat().st_size > 20_000  # a page with content, not a blank screenshot
