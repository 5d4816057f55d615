"""Reports as a user opens them: a real headless browser renders the page (skipped where no
chromium is installed, e.g. CI's fresh machine; ``apt-get install chromium`` enables it)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

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


WIDTH = 1400
"""The window a user reads the reports in: every column visible, no horizontal scrollbar."""
ROW_PX = 100
"""Most pixels a fault's row of the catalogue may take at WIDTH, on average."""
PROBE = """<script>addEventListener("load", () => { const e = document.documentElement;
  const out = document.createElement("pre"); out.id = "layout";
  out.textContent = JSON.stringify({scrollWidth: e.scrollWidth, clientWidth: e.clientWidth, height: e.scrollHeight});
  document.body.appendChild(out); });</script>"""


def _layout(page: Path, tmp_path) -> dict:
    """The page's extent in a WIDTH-pixel window, as the browser laid it out: a copy of the page with the probe
    script writes the document's scroll width, client width and height into the DOM, which is dumped."""
    probe = tmp_path / f"probe-{page.name}"
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WIDTH},2000",
                          "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(dom.split('<pre id="layout">', 1)[1].split("</pre>", 1)[0])


@pytest.fixture(scope="module")
def report_pages(tmp_path_factory) -> dict[str, Path]:
    """The fault catalogue's page (the recorded run), a convergence report, the main job's page, the step
    benchmark's recorded speedup curve, its two stacks side by side and one of its runs (Megatron's batch on 4 x H200,
    with the part-by-part attribution)."""
    from harness.bench.step.config import StepBenchConfig
    from harness.report import convergence_report, faults_report, schedule_report, step_curve, step_report, step_stacks
    from suites.repo.report_examples import RECORDED_FAULTS, convergence_result, main_result

    d = tmp_path_factory.mktemp("reports")
    recorded = Path(__file__).resolve().parents[2] / "reports" / "recorded"
    html = {"faults": faults_report.page(json.loads(RECORDED_FAULTS.read_text())),
            "convergence": convergence_report.render_standalone(convergence_result(), None)[0],
            "main": schedule_report.render(main_result())[0],
            "curve": step_curve.html_page(step_curve.load_curve(sorted(recorded.glob("bench_step.h200x4.*.json")))),
            "compare": step_stacks.html_page(step_stacks.load_rows(sorted(recorded.glob("bench_step*.h200x*.megatron-batch.json"))))}
    step = json.loads((recorded / "bench_step.h200x4.2026-11-28-megatron.json").read_text())
    html["step"] = step_report.render(step["results"], StepBenchConfig.from_dict(step["config"]), step["checks"],
                                      step["results"]["world"])
    for name, text in html.items():
        (d / f"{name}.html").write_text(text)
    return {name: d / f"{name}.html" for name in html}


@pytest.mark.parametrize("name", ["faults", "convergence", "main", "curve", "compare", "step"])
def test_every_report_fits_a_1400_pixel_window(report_pages, name, tmp_path):
    seen = _layout(report_pages[name], tmp_path)
    assert seen["scrollWidth"] <= seen["clientWidth"] <= WIDTH, seen  # no horizontal scrollbar


def test_the_fault_catalogue_rows_are_compact(report_pages, tmp_path):
    """A few lines a fault (the long text wraps or waits in a <details>), not a screen of white space."""
    from suites.repo.report_examples import RECORDED_FAULTS

    faults = len(json.loads(RECORDED_FAULTS.read_text())["faults"])
    assert _layout(report_pages["faults"], tmp_path)["height"] <= ROW_PX * faults + 1200


CHECK = """<!DOCTYPE html><html><body><pre id="out">pending</pre>
<iframe id="f" src="index.html" style="width:1400px;height:900px"></iframe>
<script>
document.getElementById("f").addEventListener("load", () => {
  const d = document.getElementById("f").contentDocument;
  const images = Array.from(d.images).map(i => i.complete && i.naturalWidth > 0 && i.naturalHeight > 0);
  const links = Array.from(d.querySelectorAll("a[href]")).map(a => ({href: a.href, text: a.textContent,
    anchor: a.hash ? d.getElementById(a.hash.slice(1)) !== null : null}));
  document.getElementById("out").textContent = JSON.stringify({images, links});
});
</script></body></html>"""


@pytest.mark.slow
def test_the_nightly_page_of_two_cpu_runs_loads_every_image_and_resolves_every_link(tmp_path):
    """Two real nightly runs into one root; the page, opened in the browser (the checker page frames it
    and reads what the browser loaded), has the summary table, both runs linked, every image decoded
    and every link pointing at a file or an element that exists."""
    import json
    from urllib.parse import unquote, urlparse

    from harness import cli
    from harness.apps.nightly import history

    root = tmp_path / "nightly"
    for i in (1, 2):
        argv = ["nightly", "--device", "cpu", "--world", "2", "--models", "tiny-gpt", "--steps", "2",
                "--root", str(root), "--json", str(tmp_path / f"s{i}.json")]
        assert cli.main(argv) == 0
    runs = history.read(root)
    assert len(runs) == 2 and all(r["verdict"] == "PASS" and r["tolerance"] == 1e-5 for r in runs)
    (root / "check.html").write_text(CHECK)
    dom = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                          "--virtual-time-budget=15000", "--dump-dom", (root / "check.html").as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    seen = json.loads(dom.split('<pre id="out">', 1)[1].split("</pre>", 1)[0].replace("&amp;", "&"))
    assert len(seen["images"]) == 2 and all(seen["images"])  # the trends, the latest run's curves (one series)
    for link in seen["links"]:
        url = urlparse(link["href"])
        assert url.scheme == "file" and Path(unquote(url.path)).exists(), link
        assert link["anchor"] is not False, link
    reports = {link["href"] for link in seen["links"] if link["text"] == "report"}
    assert reports == {(root / r["report"]).as_uri() for r in runs}
    html = (root / "index.html").read_text()
    assert "median margin (last 7)" in html and "tolerance" in html and html.count(">PASS<") == 3
