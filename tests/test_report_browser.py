"""The report and compare pages in a real browser: headless Chromium renders them from disk, no server.

Checks what only a browser can: the page renders (a screenshot that is not blank), every ``<img>`` decodes
(``naturalWidth`` > 0, read by a probe script injected into a *copy* of the page, since the page itself has
no scripts and forbids them), nothing is fetched over the network, and the rendered DOM has the sections.
Skipped with the reason when no Chromium is installed (Debian/Ubuntu: ``apt-get install chromium``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from sample_runs import failed_row, synthetic_run

from attnbench.report import build_report
from attnbench.results.compare import compare_runs, write_compare_html
from attnbench.results.schema import Cell

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome",
                                                        "google-chrome-stable")) if p), None)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium) "
                                                  "for the browser rendering test")]

PROBE = """
<script>
window.addEventListener("load", () => {
  const imgs = Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth,
                                                       h: i.naturalHeight, shown: i.getBoundingClientRect().width}));
  const fetched = performance.getEntriesByType("resource").map(e => e.name).filter(n => !n.startsWith("data:"));
  const out = document.createElement("pre");
  out.id = "attnbench-probe";
  out.textContent = JSON.stringify({imgs, fetched, width: document.documentElement.scrollWidth,
                                    viewport: window.innerWidth});
  document.body.appendChild(out);
});
</script>
"""


def chromium(tmp: Path, *args: str, timeout: int = 90) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={tmp / 'chromium-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def probe(page: Path, tmp: Path) -> tuple[dict, str]:
    """Load a copy of ``page`` with the probe script (CSP relaxed for it alone); return (probe data, DOM)."""
    html = page.read_text(encoding="utf-8")
    assert "default-src 'none'" in html  # the real page forbids scripts and network
    html = html.replace("default-src 'none'", "default-src 'none'; script-src 'unsafe-inline'")
    html = html.replace("</body>", PROBE + "</body>")
    copy = page.with_name(page.stem + "-probe.html")  # next to the page, so relative links behave the same
    copy.write_text(html, encoding="utf-8")
    res = chromium(tmp, "--virtual-time-budget=10000", "--window-size=1280,1000", "--dump-dom", copy.as_uri())
    m = re.search(r'<pre id="attnbench-probe">(.*?)</pre>', res.stdout, re.S)
    assert m, f"probe did not run; chromium rc={res.returncode}, stderr tail: {res.stderr[-800:]}"
    text = m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    return json.loads(text), res.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    evil = [failed_row(Cell(impl="evil<script>.py:X", seq_len=64, d_model=64, num_heads=4), "error",
                       "<img src=x onerror=alert(1)> boom")]
    run = synthetic_run(root, impls=("weight_split", "sdpa", "compiled:sdpa"), seq_lens=(32, 64, 128, 256),
                        modes=("forward", "inference"), extra_rows=evil, run_id="browser")
    return build_report(run, out_dir=tmp_path_factory.mktemp("report"))


def test_report_renders_in_chromium(report, tmp_path):
    shot = tmp_path / "report.png"
    res = chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,4000", report.as_uri())
    assert shot.is_file(), f"no screenshot; rc={res.returncode}, stderr tail: {res.stderr[-800:]}"
    assert shot.stat().st_size > 50_000
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (4000, 1280)
    rgb = pixels[..., :3]
    assert float(rgb.std()) > 0.05, "the screenshot is (nearly) one colour"
    top = rgb[:1500]
    dark = (top.mean(axis=2) < 0.35).mean()  # text and plot lines rendered in the first screens
    assert 0.005 < dark < 0.5
    colours = np.unique((top * 255).astype(np.uint8).reshape(-1, 3)[::7], axis=0)
    assert len(colours) > 50  # figures in colour, not blank boxes


def test_every_image_loads_and_nothing_is_fetched(report, tmp_path):
    data, dom = probe(report, tmp_path)
    n_img = report.read_text().count("<img ")
    assert n_img == 6 and len(data["imgs"]) == n_img
    for img in data["imgs"]:
        assert img["complete"] and img["w"] > 300 and img["h"] > 100, img
        assert img["shown"] > 300, img  # laid out at a readable width
    assert data["fetched"] == []
    assert data["width"] <= data["viewport"] + 1, "the page scrolls sideways"
    for heading in ("Summary", "Latency vs sequence length", "Crossovers", "Scaling exponents",
                    "Failed and skipped cells", "Environment"):
        assert re.search(rf"<h2[^>]*>{re.escape(heading)}", dom), heading
    assert "<img src=x" not in dom and "evil&lt;script&gt;.py:X" in dom  # escaped text stays text in the DOM


def test_compare_page_renders_in_chromium(tmp_path):
    a = synthetic_run(tmp_path / "runs", impls=("weight_split", "sdpa"), seq_lens=(32, 64, 128), run_id="a", seed=1)
    b = synthetic_run(tmp_path / "runs", impls=("weight_split", "sdpa"), seq_lens=(32, 64, 128), run_id="b", seed=2)
    page = write_compare_html(compare_runs(a, b), tmp_path / "cmp")
    data, dom = probe(page, tmp_path)
    assert len(data["imgs"]) == 1 and data["imgs"][0]["w"] > 300 and data["fetched"] == []
    assert "No significant slowdown" in dom
