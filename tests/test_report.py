"""``attnbench report``: the HTML page, its figures and tables, checked the way a user sees them.

Most reports are built from synthetic runs written through :class:`~attnbench.results.store.RunStore`
(``sample_runs``); one is built from a real, tiny ``attnbench.run`` with ``--profile``.
"""

from __future__ import annotations

import base64
import io
import re
from html import escape as html_escape
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from sample_runs import failed_row, ok_row, paired_columns, synthetic_run

from attnbench.cli import main
from attnbench.report import analysis as an
from attnbench.report import build_report
from attnbench.report import figures as figs
from attnbench.report.figures import impl_styles
from attnbench.report.page import ENV_DPI, ENV_FORMATS, markdown_table
from attnbench.results.schema import Cell

EVIL = "evil<script>$\\nope$.py:X"  # HTML to escape, and mathtext that would not parse if matplotlib read it
EVIL_ERROR = "<script>alert('pwned')</script> & <b>bold</b>"
SECTIONS = ["Summary", "Latency vs sequence length", "Speed-up relative to", "Peak memory", "Throughput",
            "torch.compile", "Side by side at one configuration", "Fastest implementation per configuration",
            "Crossovers", "Scaling exponents", "Noisy measurements", "Failed and skipped cells",
            "Operator breakdown", "Environment"]


@pytest.fixture(autouse=True, scope="module")
def _small_figures():
    """Reports here are read, not looked at: low-resolution PNG only, unless a test asks for the default
    (the ``full`` report checks the default output: 150 dpi PNG and SVG)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DPI, "72")
        mp.setenv(ENV_FORMATS, "png")
        yield


class Page(HTMLParser):
    """What a browser would see: headings, images, links, visible text, tags."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.headings: list[str] = []
        self.imgs: list[dict] = []
        self.links: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []
        self._in_heading = None
        self._skip = 0
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag in ("style", "title"):
            self._skip += 1
        if tag in ("h1", "h2", "h3"):
            self._in_heading = tag
            self.headings.append("")
        if tag == "img":
            self.imgs.append(a)
        for key in ("src", "href"):
            if a.get(key):
                self.links.append(a[key])

    def handle_endtag(self, tag):
        if tag in ("style", "title"):
            self._skip -= 1
        if tag == self._in_heading:
            self._in_heading = None

    def handle_data(self, data):
        if self._skip:
            return
        self.text.append(data)
        if self._in_heading:
            self.headings[-1] += data

    @property
    def visible(self) -> str:
        return " ".join("".join(self.text).split())


def decode_png(uri: str) -> np.ndarray:
    assert uri.startswith("data:image/png;base64,"), uri[:40]
    data = base64.b64decode(uri.split(",", 1)[1], validate=True)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(io.BytesIO(data), format="png")


def check_page(html_path: Path) -> Page:
    """Checks every report must pass: parses, self-contained, every image embedded and a real picture."""
    text = html_path.read_text(encoding="utf-8")
    page = Page(text)
    assert page.headings and page.headings[0] == "attnbench report"
    assert "script" not in page.tags and "link" not in page.tags and "iframe" not in page.tags
    for link in page.links:  # no network, no absolute paths: everything embedded or next to the page
        assert not re.match(r"^(https?:|//|file:|/)", link), link
        if not link.startswith(("data:", "#")):
            assert (html_path.parent / link).is_file(), f"broken link {link}"
    for img in page.imgs:
        pixels = decode_png(img["src"])
        assert pixels.shape[0] > 100 and pixels.shape[1] > 300
        assert float(pixels[..., :3].std()) > 0.02, "image is a single colour"
        assert img.get("alt")
    return page


# ---------------------------------------------------------------- the full synthetic report


def _ops_table(run: Path) -> None:
    """A profile/ops.parquet like the profiler writes: two implementations at the same configuration."""
    rows = []
    for impl, ops in (("weight_split", {"aten::bmm": 40e-6, "aten::softmax": 20e-6, "aten::masked_fill": 9e-6}),
                      ("sdpa", {"aten::_scaled_dot_product_flash_attention_for_cpu": 30e-6, "aten::addmm": 12e-6})):
        for t in (64, 512):
            for op, s in ops.items():
                rows.append({"impl": impl, "cell_id": f"{impl}|cpu|float32|b1|T{t}|h4|d64|forward|warm", "op": op,
                             "calls": 3, "self_cpu_s": s * t / 64, "cpu_total_s": s * t / 64, "self_device_s": 0.0,
                             "device_total_s": 0.0, "self_cpu_memory_bytes": 0, "cpu_memory_bytes": 0})
    (run / "profile").mkdir()
    pd.DataFrame(rows).to_parquet(run / "profile" / "ops.parquet")


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A synthetic run with two modes, failures, a noisy cell, a compiled: impl and a hostile plug-in name."""
    root = tmp_path_factory.mktemp("runs")
    evil_rows = [ok_row(Cell(impl=EVIL, seq_len=t, d_model=64, num_heads=4), 1e-4 * t / 32 * (1 + 0.01 * np.arange(9)),
                        peak_bytes=1000.0 * t, peak_gflops_per_s=1000.0) for t in (32, 64)]
    evil_rows.append(failed_row(Cell(impl=EVIL, seq_len=128, d_model=64, num_heads=4), "error", EVIL_ERROR))
    run = synthetic_run(root, modes=("forward", "inference"), extra_rows=evil_rows, run_id="full-run")
    _ops_table(run)
    out = tmp_path_factory.mktemp("report")
    html = build_report(run, out_dir=out)  # small PNGs only (_small_figures); the default output: its own test
    return run, html, check_page(html)


def test_report_writes_page_figures_and_tables(full):
    _, html, _ = full
    out = html.parent
    assert html.name == "report.html"
    for name in ("latency", "speedup", "memory", "throughput", "compile", "bars"):
        assert (out / "figures" / f"{name}.png").stat().st_size > 2000
    assert not list((out / "figures").glob("*.svg")) and ".svg" not in html.read_text()  # ATTNBENCH_REPORT_FORMATS=png
    assert matplotlib.image.imread(out / "figures" / "bars.png").shape[1] == 8 * 72  # an 8-inch figure at 72 dpi
    for name in ("fastest", "crossovers", "scaling_latency", "scaling_memory", "noisy", "failures", "status_counts",
                 "compile", "speedup", "bars", "profile_ops_1"):
        assert (out / "tables" / f"{name}.csv").is_file(), name
        assert (out / "tables" / f"{name}.md").read_text().startswith("| ")


def test_every_image_is_embedded_and_every_section_is_there(full):
    _, _, page = full
    assert len(page.imgs) == 6  # latency, speed-up, memory, throughput, compile, bars
    for section in SECTIONS:
        assert any(h.startswith(section) for h in page.headings), (section, page.headings)
    assert "not drawn" not in page.visible


def test_results_text_is_escaped(full):
    _, html, page = full
    text = html.read_text()
    assert "<script" not in text and "<b>bold</b>" not in text
    assert html_escape(EVIL, quote=False) in text
    assert EVIL in page.visible  # shown literally to the reader
    assert "<script>alert('pwned')</script> & <b>bold</b>" in page.visible
    csv = pd.read_csv(html.parent / "tables" / "failures.csv")
    assert EVIL_ERROR in set(csv["error"])


def test_analysis_in_words(full):
    _, _, page = full
    v = page.visible
    # the synthetic sdpa has a large fixed cost and a small quadratic term: it overtakes weight_split
    assert re.search(r"sdpa is faster than weight_split from T >= \d+ \(slower up to T <= \d+\)", v)
    assert "compiled:sdpa is fastest" in v
    assert "Baseline for speed-ups: weight_split" in v
    assert "CUDA out of memory at T=512 (synthetic)" in v
    assert "not divisible by num_heads=3" in v
    assert "RuntimeError: synthetic failure" in v
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in v and "aten::bmm" in v  # op breakdown
    assert "Synthetic CPU @ 3.0GHz" in v and "attnbench run --preset synthetic" in v  # environment


def test_tables_carry_the_numbers(full):
    _, html, _ = full
    tables = html.parent / "tables"
    mem = pd.read_csv(tables / "scaling_memory.csv")
    fwd = mem[mem["configuration"].str.contains("/forward ")].set_index("impl")
    assert fwd.loc["weight_split", "k_all"] == pytest.approx(2.0, abs=1e-6)  # synthetic memory ∝ T²
    assert fwd.loc["sdpa", "k_all"] == pytest.approx(1.0, abs=1e-6)  # synthetic memory ∝ T
    assert "needs >= 3 distinct T" in fwd.loc[EVIL, "note"]
    lat = pd.read_csv(tables / "scaling_latency.csv")
    assert lat["k_all"].dropna().between(0.2, 2.2).all()
    cross = pd.read_csv(tables / "crossovers.csv")
    assert cross["sentence"].str.contains(r"^sdpa is faster than weight_split from T >= \d+ on cpu/float32/forward "
                                          r"\(B=1, h=4, d=64\)").any()
    noisy = pd.read_csv(tables / "noisy.csv")
    assert noisy["cell"].str.startswith("fused_qkv @ cpu/float32/").any() and noisy["cell"].str.contains("T=32").all()
    fails = pd.read_csv(tables / "failures.csv")
    assert set(fails["status"]) == {"oom", "error", "skipped"}
    fastest = pd.read_csv(tables / "fastest.csv")
    assert set(fastest["seq_len"]) == {32, 64, 128, 256, 512}
    comp = pd.read_csv(tables / "compile.csv")
    assert (comp["break_even_calls"] > 1000).all()  # 2 s of compiling / tens of µs saved per call
    ops = pd.read_csv(tables / "profile_ops_2.csv")  # the T=512 configuration, shown in the page
    assert {"op", "weight_split self", "sdpa self", "weight_split calls", "sdpa %"} <= set(ops.columns)
    assert ops["op"].iloc[-1] == "total (all ops)"


def test_colours_are_stable_per_implementation():
    a = impl_styles(["sdpa", "weight_split", "fused_qkv"])
    b = impl_styles(["fused_qkv", "weight_split", "sdpa", "sdpa"])
    assert a == b and len({s["color"] for s in a.values()}) == 3
    many = impl_styles([f"impl{i:02d}" for i in range(20)])
    assert len({s["color"] for s in many.values()}) == 20


def test_markdown_table_escapes_pipes():
    md = markdown_table(pd.DataFrame({"a|b": ["x|y", "line\nbreak"], "n": [1, float("nan")]}))
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in md.splitlines()]
    assert cells[0] == ["a\\|b", "n"] and set(cells[1][0]) <= {"-", ":"}
    assert cells[2:] == [["x\\|y", "1.0"], ["line<br>break", ""]]
    assert len(md.splitlines()) == 4  # a newline in a cell does not break the row


def test_skipped_cells_are_left_out_of_the_latency_figure_and_its_legend_says_so(tmp_path, monkeypatch):
    from attnbench.report import figures

    legends = []
    monkeypatch.setattr(figures, "_legend", lambda fig, handles, max_cols=4: legends.append(
        [h.get_label() for h in handles]))
    ok = [ok_row(Cell(impl="sdpa", seq_len=t), [1e-4 * t / 64] * 5) for t in (64, 128)]
    skipped = failed_row(Cell(impl="sdpa_efficient", seq_len=64), "skipped", "needs CUDA")
    df = an.prepare(pd.DataFrame([*ok, skipped]))
    figures.latency(df, figures.impl_styles(df["impl"]), tmp_path)
    labels = legends[-1]
    assert "skipped cells (cannot run here): left out" in labels
    assert not any(label.startswith("failed") for label in labels) and "sdpa_efficient" not in labels
    failed = failed_row(Cell(impl="weight_split", seq_len=128), "oom", "out of memory")
    df = an.prepare(pd.DataFrame([*ok, skipped, failed]))
    figures.latency(df, figures.impl_styles(df["impl"]), tmp_path)
    assert {"failed cell (oom/error/timeout/invalid)", "weight_split"} <= set(legends[-1])


def test_without_an_operator_profile_the_page_names_run_profile(tmp_path):
    html, page = _report(tmp_path, impls=("weight_split", "sdpa"), seq_lens=(32, 64), failures=False)
    v = page.visible
    assert "`attnbench run --profile` adds profile/ops.parquet" in v
    assert "run `attnbench profile`" not in v


# ---------------------------------------------------------------- robustness


def _report(tmp_path: Path, rows: list[dict] | None = None, baseline: str = "weight_split", **kw) -> tuple[Path, Page]:
    """Build a report from ``rows`` (written through RunStore) or from a synthetic run with ``kw``."""
    root = tmp_path / "runs"
    if rows is not None:
        from attnbench.results.store import RunStore

        store = RunStore(root, run_id="custom", meta={"command": "test"})
        for r in rows:
            store.append(r)
        store.finalize()
        run = store.path
    else:
        run = synthetic_run(root, **kw)
    html = build_report(run, out_dir=tmp_path / "report", baseline=baseline)
    return html, check_page(html)


def test_only_failed_cells(tmp_path):
    rows = [failed_row(Cell(impl="sdpa", seq_len=t), "oom", f"out of memory at T={t}") for t in (64, 128)]
    rows.append(failed_row(Cell(impl="weight_split", seq_len=64), "error", "ValueError: boom"))
    html, page = _report(tmp_path, rows)
    assert page.imgs == []
    v = page.visible
    assert "No cell was timed successfully" in v
    assert "not drawn — no successful cells to plot" in v
    assert "out of memory at T=128" in v and "ValueError: boom" in v
    assert "no implementation has a successful cell" in v


def test_empty_run(tmp_path):
    html, page = _report(tmp_path, [])
    assert page.imgs == [] and "has no cells at all" in page.visible


def test_one_implementation_and_missing_baseline(tmp_path):
    html, page = _report(tmp_path, impls=("sdpa",), failures=False)
    v = page.visible
    assert "baseline 'weight_split' is not in this run; using 'sdpa' instead" in v
    assert "Speed-up relative to sdpa: not drawn — only one implementation has successful cells" in v
    assert "only sdpa has successful cells, nothing to compare" in v
    assert len(page.imgs) == 4  # latency, memory, throughput, bars
    assert "this run has no compiled: implementations" in v


def test_single_sequence_length(tmp_path):
    html, page = _report(tmp_path, impls=("weight_split", "sdpa"), seq_lens=(128,), failures=False)
    v = page.visible
    assert "Only one sequence length was measured" in v
    assert "one sequence length (T=128), so no crossover can be found" in v
    assert "needs >= 3 distinct T with a measurement to fit a slope; has 1" in v
    assert any((i.get("alt") or "").startswith("All implementations at T=128") for i in page.imgs)


def test_baseline_with_no_successful_cell_falls_back(tmp_path):
    rows = [ok_row(Cell(impl="sdpa", seq_len=t), [1e-4 * t / 64] * 5) for t in (64, 128, 256)]
    rows += [failed_row(Cell(impl="weight_split", seq_len=t), "oom", "oom") for t in (64, 128, 256)]
    html, page = _report(tmp_path, rows)
    assert "baseline 'weight_split' has no successful cell in this run; using 'sdpa' instead" in page.visible


def test_default_output_folder_is_reports_run_id(tmp_path, monkeypatch):
    run = synthetic_run(tmp_path / "runs", impls=("weight_split",), seq_lens=(32, 64), failures=False, run_id="abc")
    monkeypatch.chdir(tmp_path)
    html = build_report(run / "results.parquet")
    assert html.resolve() == (tmp_path / "reports" / "abc" / "report.html").resolve()


def test_cli_report_and_its_errors(tmp_path, capsys):
    run = synthetic_run(tmp_path / "runs", impls=("weight_split", "sdpa"), seq_lens=(32, 64), failures=False)
    main(["report", str(run), "-o", str(tmp_path / "out"), "--baseline", "sdpa"])
    assert (tmp_path / "out" / "report.html").is_file()
    assert f"report: {tmp_path / 'out' / 'report.html'}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path / "nope")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "does not exist" in err and len(err.splitlines()) == 1


def test_fastest_marks_ties_and_crossovers_are_stated_from_the_faster_side():
    spread = 1 + 0.05 * np.arange(9)  # median 1.2x the first sample, wide CI
    rows = [ok_row(Cell(impl=impl, seq_len=t), 1e-4 * scale * t * spread)
            for impl, scale in (("a", 1.0), ("b", 1.001)) for t in (64, 128, 256)]
    rows += [ok_row(Cell(impl="c", seq_len=t), np.full(9, 1.2e-2)) for t in (64, 128, 256)]
    df = an.prepare(pd.DataFrame(rows))
    f = an.fastest(df).set_index("seq_len")
    assert f.loc[64, "fastest"] == "a" and f.loc[64, "runner_up"] == "b" and "tie within CI" in f.loc[64, "note"]
    assert f.loc[256, "fastest"] == "c" and f.loc[256, "note"] == ""
    table, notes = an.crossovers(df, "a")
    assert notes == []
    ca = table[(table["a"] == "c") & (table["b"] == "a")].iloc[0]
    assert ca["vs_baseline"] and ca["kind"] == "crossover" and ca["crossover_T"] == 128
    assert ca["sentence"].startswith("c is faster than a from T >= 128 on cpu/float32/forward")
    ba = table[(table["a"] == "b") & (table["b"] == "a")].iloc[0]
    assert ba["kind"] == "always_slower" and ba["sentence"].startswith("b is slower than a at every T measured")
    cb = table[~table["vs_baseline"]].iloc[0]  # b vs c, not the baseline: stated from the faster side
    assert (cb["a"], cb["b"]) == ("c", "b") or cb["sentence"].startswith("b is faster than c up to T <= 64")


# ---------------------------------------------------------------- from a real run


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    pytest.importorskip("attnbench.runner.engine")
    import attnbench

    out = tmp_path_factory.mktemp("real")
    df = attnbench.run(impl=["weight_split", "sdpa"], seq_len=[32, 64], batch=[1], num_heads=[2], d_model=[32],
                       mode=["forward"], out=out, settings={"budget_s": 0.05, "threads": 1}, profile=True)
    return Path(df.attrs["run_dir"]), df


def test_report_from_a_real_run(real_run, tmp_path):
    run, df = real_run
    assert (df["status"] == "ok").all(), df[["impl", "seq_len", "status", "error"]]
    html = build_report(run, out_dir=tmp_path / "report")
    page = check_page(html)
    assert len(page.imgs) >= 4  # latency, speed-up, throughput, bars (+ memory when measured)
    for section in SECTIONS:
        assert any(h.startswith(section) for h in page.headings), section
    v = page.visible
    baseline = an.paired_baseline(an.prepare(df)) or "weight_split"  # the run's own when it has paired speed-ups
    assert f"Baseline for speed-ups: {baseline}" in v
    assert "needs >= 3 distinct T" in v  # only two sequence lengths
    assert "aten::" in v  # the real profiler's op table
    assert df["run_id"].iloc[0] in v


# ---------------------------------------------------------------- paired speed-ups

MANY = ("weight_split", "sdpa", "fused_qkv", "compiled:sdpa", "einsum", "torch_mha", "flex")


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """Seven implementations with paired speed-ups against sdpa, two modes x two T: the prepared rows and speed-ups."""
    run = synthetic_run(tmp_path_factory.mktemp("many"), impls=MANY, seq_lens=(64, 256), failures=False, noisy=False,
                        paired="sdpa", modes=("inference", "forward+backward"))
    df = an.prepare(pd.read_parquet(run / "results.parquet"))
    return df, an.speedups(df, "sdpa")


def _speedup_figures(df: pd.DataFrame, sp: pd.DataFrame, out: Path) -> list:
    with figs.rendering(figs.Render(dpi=30, svg=False)):
        return figs.speedup(df, sp, "sdpa", impl_styles(df["impl"]), out)


def test_many_implementations_get_a_heatmap_a_few_get_lines(many, tmp_path):
    df, sp = many
    heat = _speedup_figures(df, sp, tmp_path / "many")
    assert [f.kind for f in heat] == ["heatmap"] and "geometric-mean" in heat[0].caption and heat[0].png.is_file()
    six = df[df["impl"] != "flex"]
    lines = _speedup_figures(six, an.speedups(six, "sdpa"), tmp_path / "six")
    assert {f.kind for f in lines} == {"panels"} and "Paired speed-ups" in lines[0].caption


def test_heatmap_cells_carry_the_speedup_and_its_ci_ordered_by_geometric_mean(many):
    df, sp = many
    grid = an.speedup_grid(df, sp, "sdpa")
    assert "sdpa" not in grid.speedup.index and len(grid.speedup) == len(MANY) - 1
    geo = np.exp(np.log(grid.speedup).mean(axis=1))
    assert list(grid.speedup.index) == list(geo.sort_values(ascending=False).index)  # fastest on top
    assert grid.labels == ["inference\nT=64", "inference\nT=256", "forward+backward\nT=64", "forward+backward\nT=256"]
    r = sp[(sp["impl"] == "fused_qkv") & (sp["seq_len"] == 256)].iloc[0]
    text = grid.text.loc["fused_qkv", (int(r["group"]), 256)]
    assert text == f"{r['speedup']:.2f}×\n{r['speedup_ci_low']:.2f}–{r['speedup_ci_high']:.2f}"


def test_sentences_and_the_crossover_use_the_paired_speedups(tmp_path):
    # medians say "new" is 10% slower than the baseline; the paired speed-up (timed in alternation) says 5% faster
    rows = []
    for t in (64, 128):
        base, new = Cell(impl="base", seq_len=t), Cell(impl="new", seq_len=t)
        rows.append(ok_row(base, [1e-4] * 9, **paired_columns(base, "base", 1.0)))
        rows.append(ok_row(new, [1.1e-4] * 9, **paired_columns(new, "base", 1.05, (1.02, 1.08)),
                           **({"stability": "unstable", "notes": "unstable: modes 1.0e-04 and 1.2e-04"} if t == 128
                              else {})))
    lost = Cell(impl="new", seq_len=256)  # its baseline failed in this group: no paired speed-up
    rows.append(ok_row(lost, [1e-4] * 9, **{**paired_columns(lost, "base", float("nan"), (float("nan"),) * 2),
                                           "notes": "no paired speed-up: the baseline base failed"}))
    rows.append(failed_row(Cell(impl="base", seq_len=256), "error", "boom"))
    html, page = _report(tmp_path, rows, baseline=None)
    v = page.visible
    assert "1 cell(s) have no paired speed-up and are left out: new @ cpu/float32/forward (B=1, h=4, d=256) T=256: " \
           "no paired speed-up: the baseline base failed" in v
    assert "Baseline for speed-ups: base" in v  # the run's own baseline by default
    assert "new vs base (paired, 95% CI): 1.05× (1.02–1.08) at T=64; 1.05× (1.02–1.08) at T=128." in v
    assert "Unstable at T=128: the speed-up there may move between runs." in v
    assert "new is faster than base at every T measured" in v and "by paired speed-up" in v
    assert "ratios of medians" not in v
    table = pd.read_csv(html.parent / "tables" / "speedup.csv")
    assert table["paired"].all() and table.set_index("seq_len").loc[128, "unstable"]
    shown = (html.parent / "tables" / "speedup.md").read_text()
    assert "1.05× (1.02–1.08), unstable" in shown


def test_older_runs_fall_back_to_the_ratio_of_medians_and_say_so(tmp_path):
    html, page = _report(tmp_path, impls=("weight_split", "sdpa"), seq_lens=(32, 64), failures=False)
    v = page.visible
    assert "this run predates paired speed-ups" in v and "ratio of medians, no CI" in v
    table = pd.read_csv(html.parent / "tables" / "speedup.csv")
    assert not table["paired"].any()
    assert np.allclose(table["speedup"], table["baseline_median_s"] / table["median_s"])


def test_report_resolution_and_formats(tmp_path, monkeypatch):
    run = synthetic_run(tmp_path / "runs", impls=("weight_split", "sdpa"), seq_lens=(32, 64), failures=False)
    monkeypatch.delenv(ENV_DPI)
    monkeypatch.delenv(ENV_FORMATS)
    html = build_report(run, out_dir=tmp_path / "default")  # the default output: 150 dpi PNG and an SVG each
    assert matplotlib.image.imread(tmp_path / "default" / "figures" / "latency.png").shape[1] == 7 * 150  # 7-inch figure
    for name in ("latency", "speedup", "memory", "throughput", "bars"):
        svg = (tmp_path / "default" / "figures" / f"{name}.svg").read_text()
        assert "<svg" in svg and not re.search(r"href=\"(https?:|//)", svg)  # fonts as paths, nothing fetched
        assert f"figures/{name}.svg" in html.read_text()
    monkeypatch.setenv(ENV_FORMATS, "pdf")
    with pytest.raises(Exception, match="formats png or png,svg"):
        build_report(run, out_dir=tmp_path / "bad")


def test_the_report_a_run_ends_with_has_png_figures_and_names_the_command_for_svg(tmp_path, monkeypatch):
    from attnbench.cli.run import _write_report

    run = synthetic_run(tmp_path / "runs", impls=("weight_split", "sdpa"), seq_lens=(32, 64), failures=False)
    monkeypatch.delenv(ENV_FORMATS)
    html = _write_report(run, str(tmp_path / "end"), quiet=True)
    figures = tmp_path / "end" / "figures"
    assert (figures / "latency.png").is_file() and not list(figures.glob("*.svg"))
    page = Page(html.read_text())
    assert f"attnbench report {run}" in page.visible and "SVG copies" in page.visible
    assert all(i["src"].startswith("data:image/png;base64,") for i in page.imgs)  # the page itself is unchanged

    monkeypatch.setenv(ENV_FORMATS, "png,svg")  # asked for: SVG copies too, and no note
    html = _write_report(run, str(tmp_path / "both"), quiet=True)
    assert (tmp_path / "both" / "figures" / "latency.svg").is_file() and "SVG copies" not in Page(html.read_text()).visible
