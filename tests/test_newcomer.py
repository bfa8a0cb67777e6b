"""What a new user tripped over on a fresh clone (issue 40), each fixed and kept fixed here: a bare ``pytest``, tables
that fit a terminal, ``compare`` and ``report`` on the folder ``--out`` was given, the help of ``run`` and ``check``,
the progress bar's count."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from attnbench.cli import main
from attnbench.results.schema import Cell
from tests.sample_runs import ok_row, synthetic_run

REPO = Path(__file__).resolve().parent.parent


def _cli(argv, capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_a_bare_pytest_collects_the_tests_that_share_helpers():
    pytest_script = Path(sys.executable).parent / "pytest"
    if not pytest_script.exists():
        pytest.skip("no pytest console script beside this interpreter")
    files = ["tests/test_context.py", "tests/test_rope_bugs.py", "tests/test_rope_sweep.py"]
    out = subprocess.run([str(pytest_script), "--co", "-q", "-n", "0", "-p", "no:cacheprovider", *files], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "No module named 'tests'" not in out.stdout + out.stderr


# ---------------------------------------------------------------- tables that fit

def _printed(renderable, width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text().splitlines()


def _a_run(impls=("weight_split", "sdpa_efficient", "compiled:sdpa@max-autotune")) -> pd.DataFrame:
    from attnbench.runner.cell import merge_rounds

    rng = np.random.default_rng(0)
    return pd.DataFrame([merge_rounds([ok_row(Cell(impl, seq_len=t), rng.lognormal(-7, 0.05, 60))])
                         for impl in impls for t in (128, 256, 512)])


@pytest.mark.parametrize("width", [80, 100])
def test_the_run_summary_fits_the_terminal_with_whole_names_and_intervals(width):
    from attnbench.cli.run import summary_table

    lines = _printed(summary_table(_a_run(), "attnbench run 2026-12-02T10-00-00"), width)
    assert max(len(line) for line in lines) <= width
    for name in ("weight_split", "sdpa_efficient", "compiled:sdpa@max-autotune"):
        assert sum(name in line for line in lines) == 3  # whole, on each of its rows
    assert "(cpu float32 forward b=1 h=4 d=256)" in " ".join(lines)  # what every row shares, said once
    assert all("%" in line for line in lines if "µs" in line)  # the ±CI column is there, uncut


@pytest.mark.parametrize("width", [80, 100])
def test_list_is_one_line_per_implementation_and_fits(monkeypatch, width):
    from attnbench import registry
    from attnbench.cli import listing

    buf = io.StringIO()
    monkeypatch.setattr(listing, "console", Console(width=width, file=buf, highlight=False))
    main(["list"])
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width
    names = registry.listed()
    for name in names:
        assert sum(line.split()[:1] == [name] for line in lines) == 1, name
    assert len(lines) < len(names) + 12  # the wide table was ~5 lines an implementation (795 at 80 columns)


def test_list_wide_has_every_column(monkeypatch):
    from attnbench.cli import listing

    buf = io.StringIO()
    monkeypatch.setattr(listing, "console", Console(width=300, file=buf, highlight=False))
    main(["list", "--wide"])
    text = buf.getvalue()
    assert "source" in text and "dropout" in text and "Raschka" in text


# ---------------------------------------------------------------- the folder --out was given

def test_compare_and_report_accept_the_folder_holding_one_run(tmp_path, capsys, monkeypatch):
    synthetic_run(tmp_path / "r1", impls=("weight_split", "sdpa"), seq_lens=(32, 64), failures=False, run_id="a")
    synthetic_run(tmp_path / "r2", impls=("weight_split", "sdpa"), seq_lens=(32, 64), failures=False, run_id="b",
                  seed=1)
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(["compare", "r1", "r2", "-o", str(tmp_path / "cmp")], capsys)
    assert code in (0, 1) and "meta.json" not in err, err
    assert (tmp_path / "cmp" / "compare.html").is_file()

    (tmp_path / "r1" / "a" / "report").mkdir()  # where `attnbench run --out r1` put its report
    code, out, err = _cli(["report", "r1"], capsys)
    assert code == 0, err
    assert (tmp_path / "r1" / "a" / "report" / "report.html").is_file()
    assert not (tmp_path / "reports").exists()  # no second copy under ./reports/


def test_a_folder_of_several_runs_names_them(tmp_path, capsys):
    synthetic_run(tmp_path / "many", impls=("sdpa",), seq_lens=(32,), failures=False, run_id="x")
    synthetic_run(tmp_path / "many", impls=("sdpa",), seq_lens=(32,), failures=False, run_id="y")
    code, _, err = _cli(["compare", str(tmp_path / "many"), str(tmp_path / "many" / "x")], capsys)
    assert code == 2
    assert "holds 2 runs" in err and str(tmp_path / "many" / "x") in err and str(tmp_path / "many" / "y") in err


# ---------------------------------------------------------------- help

def test_run_help_is_grouped_with_every_option_in_a_section(capsys):
    from attnbench.cli.grouped import ungrouped
    from attnbench.cli.run import run_cmd

    assert ungrouped(run_cmd) == []
    code, out, _ = _cli(["run", "--help"], capsys)
    assert code == 0
    starts = [out.index(f"\n{title}:\n") for title in ("What to run", "The grid", "Measurement", "Output", "Execution")]
    assert starts == sorted(starts)
    options = out[starts[0]:]
    assert options.index("--impl") < options.index("--batch") < options.index("--budget") < options.index("--out ") \
        < options.index("--executor")


def test_run_help_lists_every_preset_and_the_sampling_defaults(capsys):
    from attnbench.runner.sweep import Settings, preset_names

    _, out, _ = _cli(["run", "--help"], capsys)
    flat = " ".join(out.split())
    for name in preset_names():
        assert name in flat.replace("- ", "-"), name  # (the help wraps at a name's hyphen)
    assert "llama3" in flat
    defaults = Settings()
    assert f"Sampling seconds per cell (after warm-up). Default: {defaults.budget_s:g}" in flat
    assert f"Default: {defaults.target_rel_ci:g}" in flat
    assert f"pooling the samples. Default: {defaults.rounds}" in flat


def test_check_help_is_grouped_and_says_what_a_bare_check_runs(capsys):
    from attnbench.cli.check import check_cmd
    from attnbench.cli.grouped import ungrouped

    assert ungrouped(check_cmd) == []
    _, out, _ = _cli(["check", "--help"], capsys)
    flat = " ".join(out.split())
    assert "hf: names" in flat and "only when named" in flat
    assert "every available implementation" not in flat


# ---------------------------------------------------------------- the progress bar

def test_the_progress_bar_counts_cells_not_rounds():
    from attnbench.cli.run import _progress

    bar, on_progress = _progress(False, lambda: 2)  # 2 rounds: the engine counts 144 for 72 cells
    cell = Cell("sdpa")
    try:
        on_progress(0, 144, cell, None)
        on_progress(50, 144, cell, {"status": "ok"})
        (task,) = bar.tasks
        assert task.total == 72 and task.completed == 25
    finally:
        bar.stop()


# ---------------------------------------------------------------- a plug-in that fails check

TINY = ["--seq", "16", "--batch", "1", "--heads", "2", "--d-model", "16", "--mode", "forward", "--budget", "0.05",
        "--no-report"]


def test_run_says_a_plugin_fails_the_correctness_probe_on_its_rows_and_in_the_console(tmp_path, capsys):
    from attnbench.results.store import read_meta

    buggy = f"{REPO / 'tests' / 'plugins' / 'buggy.py'}:NoScale"
    right = f"{REPO / 'tests' / 'plugins' / 'buggy.py'}:Baseline"
    code, out, err = _cli(["run", "--out", str(tmp_path), *TINY, "--impl", f"{right},{buggy}"], capsys)
    assert code == 0, err
    assert f"warning: {buggy} fails the correctness probe before timing" in " ".join(err.split())
    rows = [line for line in out.splitlines() if "NoScale" in line or "Baseline" in line]
    assert any("NoScale" in line and "fails check" in line for line in rows)
    assert not any("Baseline" in line and "fails check" in line for line in rows)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert list(read_meta(run_dir)["failed_correctness_probe"]) == [buggy]


def test_plugin_files_are_shown_by_their_shortest_distinct_tail_in_the_console():
    """An absolute plug-in path took a whole 80-column table, and cut `fails check` to `fa…` (CI, 2026-12-02)."""
    from attnbench.results.text import short_names

    names = short_names(["/a/b/buggy.py:NoScale", "/a/b/buggy.py:Baseline", "/a/c/buggy.py:NoScale", "sdpa",
                         "pkg.mod:Attn"])
    assert names == {"/a/b/buggy.py:NoScale": "b/buggy.py:NoScale", "/a/b/buggy.py:Baseline": "buggy.py:Baseline",
                     "/a/c/buggy.py:NoScale": "c/buggy.py:NoScale", "sdpa": "sdpa", "pkg.mod:Attn": "pkg.mod:Attn"}


def test_a_long_plugin_path_keeps_the_fails_check_flag_whole_on_an_80_column_console(tmp_path, capsys, monkeypatch):
    import shutil

    from attnbench.cli.app import console

    deep = tmp_path / ("a-folder-with-a-long-name-" * 3) / "plugins"
    deep.mkdir(parents=True)
    shutil.copy(REPO / "tests" / "plugins" / "buggy.py", deep / "buggy.py")
    monkeypatch.setattr(console, "width", 80)
    buggy, right = f"{deep / 'buggy.py'}:NoScale", f"{deep / 'buggy.py'}:Baseline"
    code, out, err = _cli(["run", "--out", str(tmp_path / "out"), *TINY, "--impl", f"{right},{buggy}"], capsys)
    assert code == 0, err
    assert any("buggy.py:NoScale" in line and "fails check" in line for line in out.splitlines()), out
    assert f"buggy.py:NoScale = {buggy}" in out
