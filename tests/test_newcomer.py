"""What a new user tripped over on a fresh clone (issue 40), each fixed and kept fixed here: a bare ``pytest``, tables
that fit a terminal, ``compare`` and ``report`` on the folder ``--out`` was given, the help of ``run`` and ``check``,
the progress bar's count."""

from __future__ import annotations

import io
import os
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


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
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


# ---------------------------------------------------------------- issue 45: the newcomer's list

def test_a_short_named_plugin_that_fails_check_is_flagged_on_its_rows():
    """``--impl mine=bug.py:Class``: the rows are called ``mine``, the probe's failure was keyed by the full name, and
    no row carried `fails check` (the path-only form did)."""
    from attnbench.cli.run import summary_table

    failing = {"mine=/a/b/buggy.py:NoScale": "fails the correctness probe before timing"}
    lines = _printed(summary_table(_a_run(("mine", "sdpa")), "t", failing, width=100), 100)
    rows = [line for line in lines if "mine" in line or "sdpa" in line]
    assert sum("mine" in line and "fails check" in line for line in rows) == 3
    assert not any("sdpa" in line and "fails check" in line for line in rows)


@pytest.mark.slow  # subprocesses that import the whole CLI (about 15 s): the slow set runs it
def test_tables_follow_columns_when_output_goes_to_a_file():
    """Piped, the console was 200 columns whatever ``COLUMNS`` said; it is still 200 when ``COLUMNS`` is not set."""

    def width(environ: dict) -> int:  # stdout is a pipe here, as when the output goes to a file
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | environ
        out = subprocess.run([sys.executable, "-c", "from attnbench.cli.app import console; print(console.width)"],
                             cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.split()[-1])

    assert width({"COLUMNS": "90"}) == 90
    assert width({}) == 200


def test_the_speedup_axis_labels_ticks_across_the_data(tmp_path, monkeypatch):
    """Speed-ups of 0.8-1.3x on a log axis were labelled `1×` alone."""
    from attnbench.report import analysis as an
    from attnbench.report import figures as figs
    from tests.sample_runs import synthetic_run

    run = synthetic_run(tmp_path / "r", impls=("weight_split", "sdpa"), seq_lens=(64, 256), failures=False,
                        noisy=False, paired="sdpa", slow={"weight_split": 1.25})
    df = an.prepare(pd.read_parquet(run / "results.parquet"))
    labels: list[list[str]] = []
    save = figs._save

    def spy(fig, out_dir, name):
        for ax in fig.axes:
            lo, hi = ax.get_ylim()
            formatter = ax.yaxis.get_major_formatter()
            labels.append([formatter(t) for t in ax.get_yticks() if lo <= t <= hi])
        return save(fig, out_dir, name)

    monkeypatch.setattr(figs, "_save", spy)
    with figs.rendering(figs.Render(dpi=30, svg=False)):
        figs.speedup(df, an.speedups(df, "sdpa"), "sdpa", figs.impl_styles(df["impl"]), tmp_path / "fig")
    assert labels
    for panel in labels:
        assert len(panel) >= 3 and "1×" in panel, panel
    from attnbench.report.figures import ratio_ticks

    assert ratio_ticks(0.45, 2.2) == [0.5, 1.0, 2.0] and ratio_ticks(0.78, 1.3) == [0.8, 1.0, 1.25]
    assert len(ratio_ticks(0.97, 1.04)) >= 3 and len(ratio_ticks(1e-3, 1e5)) <= figs.MAX_RATIO_TICKS


def _plugin_file(path: Path, *classes: str) -> Path:
    body = "from torch import nn\n\n" + "".join(
        f"class {c}(nn.Module):\n    def __init__(self, d_in, d_out, num_heads, dropout=0.0, qkv_bias=False, "
        f"context_length=64):\n        super().__init__()\n        self.out = nn.Linear(d_in, d_out)\n\n"
        f"    def forward(self, x):\n        return self.out(x)\n\n\n" for c in classes)
    path.write_text(body)
    return path


def test_check_of_a_file_without_a_class_names_its_classes(tmp_path, capsys, monkeypatch):
    """`check my_attn.py` said "unknown implementation"; it names the file's nn.Module classes and how to pick one."""
    monkeypatch.chdir(tmp_path)
    _plugin_file(tmp_path / "my_attn.py", "Rotary", "MyAttention")
    code, _, err = _cli(["check", "my_attn.py"], capsys)
    flat = " ".join(err.split())
    assert code == 2 and "unknown implementation" not in flat, err
    assert "Rotary, MyAttention" in flat and "`attnbench check my_attn.py:MyAttention`" in flat
    _plugin_file(tmp_path / "other.py", "Block", "Mixer")  # no class says attention: the first as the example
    code, _, err = _cli(["check", "--impl", "mine=other.py"], capsys)
    flat = " ".join(err.split())
    assert code == 2 and "Block, Mixer" in flat and "mine=other.py:Block" in flat


@pytest.mark.slow  # subprocesses that import the whole CLI (about 15 s): the slow set runs it
def test_start_up_counts_from_the_command_not_from_the_shell_line_before_it():
    """`bash -c '... && attnbench run'` execs the command in the process bash forked before its earlier commands ran;
    /proc/self/stat's start time is that fork, so "start-up" held the shell's earlier commands (pip's minutes)."""
    code = ("import sys; sys.argv = ['attnbench']; import pandas as pd; from attnbench.cli.run import _startup_s; "
            "from attnbench.runner.phases import process_age_s; df = pd.DataFrame(); df.attrs['session_wall_s'] = 0.0; "
            "print(process_age_s() - _startup_s(df))")
    out = subprocess.run(["bash", "-c", f'sleep 3 && "{sys.executable}" -c "{code}"'], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) >= 2.5  # the shell's 3 s are not the command's start-up


class _Clock:
    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t


class _InterruptedExecutor:
    """Round 1 of a two-round run delivers both cells' rows at t=10 (9 s of measured phases); round 2 is interrupted
    by Ctrl-C at t=30, before any row."""

    def __init__(self, clock):
        self.wall, self.calls = clock, 0

    def execute(self, units, on_row, on_start=None):
        from tests.sample_runs import ok_row

        self.calls += 1
        if self.calls == 2:
            self.wall.t = 30.0
            raise KeyboardInterrupt
        self.wall.t = 10.0
        for unit in units:
            for cell in unit.cells:
                on_row(cell, {**ok_row(cell, [1e-3] * 5), "phase_build_s": 0.5, "phase_timed_s": 4.0})

    def close(self):
        pass

    def environment(self):
        return {"workers": [], "nodes": []}


def test_an_interrupted_run_files_its_time_under_what_it_did_not_bookkeeping(tmp_path, monkeypatch):
    """After Ctrl-C the rounds measured of unfinished cells (kept in memory until their last round) and the cells in
    flight read as bookkeeping: most of the run."""
    from attnbench.results.store import read_meta
    from attnbench.runner import session as session_mod
    from attnbench.runner.sweep import Settings, Sweep

    clock = _Clock()
    monkeypatch.setattr(session_mod, "time", clock)
    sweep = Sweep(impl=("sdpa", "weight_split"), seq_len=(16,), batch=(1,), num_heads=(2,), d_model=(16,),
                  mode=("forward",), settings=Settings(rounds=2, drift=0.0, cpu_bind=False))
    s = session_mod.RunSession.start(sweep, out=tmp_path, executor="local",
                                     make_executor=lambda kind, settings, rid: _InterruptedExecutor(clock))
    with pytest.raises(KeyboardInterrupt):
        s.measure(lock="off")
    s.interrupted = True
    clock.t = 31.0
    p = read_meta(s.finish().attrs["run_dir"])["phases"]
    assert p["timed cycles"] == 8.0 and p["building"] == 1.0
    assert p["interrupted"] == 20.0 and p["bookkeeping"] == pytest.approx(2.0) and p["wall"] == 31.0


def _progress_line(bar, width: int) -> str:
    return " ".join(_printed(bar.make_tasks_table(bar.tasks), width))


class _LongCells:
    """An executor whose cells are long: it records the progress line at several widths as the first cell starts,
    before any has finished."""

    def __init__(self, bar):
        self.bar, self.lines = bar, {}

    def execute(self, units, on_row, on_start=None):
        from tests.sample_runs import ok_row

        on_start(units[0].cells[0])
        self.lines = {width: _progress_line(self.bar, width) for width in (60, 80, 100)}
        for unit in units:
            for cell in unit.cells:
                on_row(cell, ok_row(cell, [1e-3] * 5))

    def close(self):
        pass

    def environment(self):
        return {"workers": [], "nodes": []}


def test_the_progress_line_keeps_the_count_and_an_eta_from_the_plan_at_any_width(tmp_path):
    """At 100 columns the line kept the cell's name and cut the count and the ETA; a sweep of long cells showed
    `0/64` and ETA `-:--:--` for minutes although the plan predicts each cell's time."""
    from attnbench.cli.run import _progress
    from attnbench.runner.session import RunSession
    from attnbench.runner.sweep import Settings, Sweep

    bar, on_progress = _progress(False)
    executor = _LongCells(bar)
    sweep = Sweep(impl=("compiled:sdpa@max-autotune", "sdpa"), seq_len=(1024, 2048, 4096, 8192), batch=tuple(range(1, 9)),
                  num_heads=(12,), d_model=(768,), mode=("forward+backward",),
                  settings=Settings(budget_s=30.0, drift=0.0, cpu_bind=False))
    session = RunSession.start(sweep, out=tmp_path, executor="local", make_executor=lambda *a: executor,
                               progress=on_progress)
    try:
        session.measure(lock="off")
    finally:
        bar.stop()
    for width, line in executor.lines.items():
        assert len(line) <= width and "0/64" in line, line
        eta = line.split("ETA ")[1].split()[0]
        assert eta != "-:--:--", line
        h, m, sec = (int(x) for x in eta.split(":"))
        assert 3600 * h + 60 * m + sec >= 64 * 30, line  # 64 cells of a 30 s budget each, at least
    assert "…" in executor.lines[100]  # the cell's name is what gives way


def test_the_eta_counts_down_and_learns_from_the_finished_cells():
    from attnbench.cli.progress import RunProgress
    from attnbench.runner.sweep import Settings

    now = [0.0]
    cells = [Cell("sdpa", seq_len=t, batch=b) for t in (1024, 2048) for b in (1, 2)]
    progress = RunProgress(Console(file=io.StringIO(), width=100), now=lambda: now[0])
    progress.plan(cells, Settings(budget_s=30.0))
    forecast = progress.forecast
    try:
        progress(0, len(cells), cells[0], None)
        eta = forecast.eta_s(now[0])
        assert eta == pytest.approx(sum(forecast.predicted_s(c.cell_id) for c in cells)) and eta > 4 * 30
        now[0] = 10.0  # the first cell is running: the ETA counts down (as far as its own prediction)
        assert forecast.eta_s(now[0]) == pytest.approx(eta - 10.0)
        first = forecast.predicted_s(cells[0].cell_id)
        now[0] = 2 * first  # it took twice its prediction: the rest are scaled by that
        progress(1, len(cells), cells[0], {"status": "ok"})
        assert forecast.eta_s(now[0]) == pytest.approx(2 * (eta - first))
    finally:
        progress.bar.stop()
