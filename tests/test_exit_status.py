"""Issue 28: no silent failure. Every total or partial failure is a non-zero exit with one line saying why."""

import errno
import shutil
from pathlib import Path

import pytest
from sample_runs import failed_row, synthetic_run

from attnbench.cli import main
from attnbench.results.store import load_run
from tests.refusal_text import refusal_text  # a refusal: an error: headline, a few short indented lines

PLUGINS = Path(__file__).parent / "plugins"
TINY = ["--seq", "16", "--batch", "1", "--heads", "2", "--d-model", "16", "--mode", "forward", "--rounds", "1",
        "--budget", "0.05", "--no-report", "-q"]


def cli(argv, capsys) -> tuple[int, str, str]:
    """``attnbench ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def only_run(out: Path) -> Path:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


# --- plug-ins that end the process ------------------------------------------------------------------

def test_check_of_a_plugin_calling_os_exit_fails_and_says_so(capsys):
    code, out, _ = cli(["check", "--impl", f"{PLUGINS / 'faulty.py'}:ExitsProcess", "--kind", "forward"], capsys)
    assert code == 1
    assert "called os._exit(0)" in out and "FAIL" in out


def test_check_of_a_plugin_calling_sys_exit_in_forward_fails(capsys):
    code, out, _ = cli(["check", "--impl", f"{PLUGINS / 'faulty.py'}:SysExits", "--kind", "forward"], capsys)
    assert code == 1 and "called sys.exit(4)" in out


@pytest.mark.parametrize("command", ["check", "run"])
def test_sys_exit_at_import_is_one_line_naming_it(command, tmp_path, capsys):
    args = ["check", "--impl"] if command == "check" else ["run", "--out", str(tmp_path), *TINY, "--impl"]
    code, _, err = cli([*args, f"{PLUGINS / 'exits_at_import.py'}:Attention"], capsys)
    assert code == 2
    assert error_lines(err) == [line for line in err.splitlines() if line.strip()]
    assert len(error_lines(err)) == 1 and "called sys.exit(3)" in err and "exits_at_import.py" in err


def test_run_of_a_plugin_calling_os_exit_records_the_call_and_keeps_the_other_rows(tmp_path, capsys):
    code, _, err = cli(["run", "--out", str(tmp_path), *TINY, "--impl", f"sdpa,{PLUGINS / 'faulty.py'}:ExitsProcess"],
                       capsys)
    df, _ = load_run(only_run(tmp_path))
    assert code == 1 and len(df) == 2
    assert dict(zip(df.impl, df.status, strict=True))["sdpa"] == "ok"
    assert "called os._exit(0)" in df[df.status == "error"].error.iloc[0]
    assert "1 of 2 cells failed (1 error)" in error_lines(err)[0]


# --- exit status of run and compare -----------------------------------------------------------------

def test_run_of_an_impossible_shape_is_a_usage_error_before_anything_runs(tmp_path, capsys):
    # issue 40: it was a run of one skipped cell, an empty report and exit 1
    code, _, err = cli(["run", "--out", str(tmp_path), *TINY, "--impl", "sdpa", "--d-model", "30", "--heads", "4"],
                       capsys)
    assert code == 2
    line = refusal_text(err)
    assert "--d-model 30 is not divisible by --heads 4" in line and "multiple of 4" in line
    assert not list(tmp_path.iterdir())  # no run folder, no report


def test_run_with_a_plugin_erroring_in_every_cell_exits_1(tmp_path, capsys):
    code, _, err = cli(["run", "--out", str(tmp_path), *TINY, "--impl", f"{PLUGINS / 'faulty.py'}:Raises"], capsys)
    assert code == 1
    (line,) = error_lines(err)
    assert "no cell was measured (1 error)" in line and "deliberate failure" in line


def test_compare_of_runs_sharing_no_cell_exits_2(tmp_path, capsys):
    a = synthetic_run(tmp_path, impls=("sdpa",), seq_lens=(32,), failures=False, run_id="a")
    b = synthetic_run(tmp_path, impls=("sdpa",), seq_lens=(64,), failures=False, run_id="b")
    code, out, err = cli(["compare", str(a), str(b), "-o", str(tmp_path / "cmp")], capsys)
    assert code == 2
    (line,) = error_lines(err)
    assert "share no timed cell (1 cell(s) only in A, 1 only in B)" in line
    assert "OK" not in out


# --- run folders in either form ---------------------------------------------------------------------

def test_a_run_folder_kept_as_results_parquet_and_meta_json_reads_whole(tmp_path):
    run = synthetic_run(tmp_path, impls=("sdpa", "weight_split"), seq_lens=(32, 64), failures=False, run_id="kept")
    full, _ = load_run(run)
    shutil.rmtree(run / "cells")
    df, meta = load_run(run)
    assert len(df) == len(full) == 4 and set(df.cell_id) == set(full.cell_id) and meta["run_id"] == "kept"


def test_a_partial_cells_folder_loses_no_row_of_results_parquet(tmp_path):
    run = synthetic_run(tmp_path, impls=("sdpa", "weight_split"), seq_lens=(32,), failures=False, run_id="part")
    first = sorted((run / "cells").glob("*.parquet"))[0]
    first.unlink()
    assert len(load_run(run)[0]) == 2


# --- environment errors: one line, nothing half-written, nothing lost --------------------------------

def test_out_on_a_path_that_cannot_be_a_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, _, err = cli(["run", "--out", str(blocker / "results"), *TINY, "--impl", "sdpa"], capsys)
    assert code == 2 and "Traceback" not in err
    line = refusal_text(err)  # one refusal: an error: headline, then at most a few short lines
    assert line.startswith("error: cannot write") and "choose another --out" in line


@pytest.mark.parametrize("code_, words", [(errno.EROFS, "read-only"), (errno.EACCES, "permission denied")])
def test_an_unwritable_out_is_one_line(code_, words, tmp_path, capsys, monkeypatch):
    real_mkdir = Path.mkdir

    def refuse(self, *a, **kw):
        if str(self).startswith(str(tmp_path / "ro")):
            raise OSError(code_, "refused", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", refuse)
    code, _, err = cli(["run", "--out", str(tmp_path / "ro"), *TINY, "--impl", "sdpa"], capsys)
    assert code == 2
    line = refusal_text(err)
    assert words in line and "choose another --out" in line


def test_a_full_disk_is_one_line_leaves_no_tmp_and_resume_completes_the_run(tmp_path, capsys, monkeypatch):
    from attnbench.results import store

    real = store.pq.write_table
    written = []

    def fill_up(table, where, *a, **kw):
        if "cells" in str(where) and written:  # the second cell's file: the disk is full halfway through it
            Path(where).write_bytes(b"PAR1 half")
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(where)
        return real(table, where, *a, **kw)

    monkeypatch.setattr(store.pq, "write_table", fill_up)
    code, _, err = cli(["run", "--out", str(tmp_path), *TINY, "--impl", "sdpa,weight_split"], capsys)
    run_dir = only_run(tmp_path)
    assert code == 2 and "Traceback" not in err
    line = refusal_text(err[err.rindex("error: "):])
    assert "the disk is full" in line and f"attnbench run --resume {run_dir}" in line
    assert not list(run_dir.rglob("*.tmp"))
    assert len(load_run(run_dir)[0]) == 1  # the first cell is kept
    monkeypatch.setattr(store.pq, "write_table", real)
    code, _, err = cli(["run", "--resume", str(run_dir), "-q", "--no-report"], capsys)
    df, _ = load_run(run_dir)
    assert code == 0, err
    assert sorted(df.impl) == ["sdpa", "weight_split"] and set(df.status) == {"ok"}


# --- the smaller items ------------------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "words"), [
    ('[sweep]\nimpl = ["sdpa"]\nseq = "abc"\n', "[sweep] seq = 'abc' in 'sweep': 'abc' is not an integer"),
    ('[sweep]\nimpl = ["sdpa"]\nheads = true\n', "[sweep] heads = True"),
    ('[sweep]\nimpl = ["sdpa"]\n[measure]\nbudget_s = "fast"\n', "[measure] budget_s = 'fast' in 'sweep' must be a TOML float"),
    ('[sweep]\nimpl = ["sdpa"]\n[measure]\nrounds = 1.5\n', "[measure] rounds = 1.5 in 'sweep' must be a TOML int"),
    ("", "sweep file"),
    ('[sweep]\nimpl = []\n', "[sweep] impl in 'sweep' is empty"),
])
def test_a_bad_toml_is_one_line_naming_its_key(toml, words, tmp_path, capsys):
    path = tmp_path / "sweep.toml"
    path.write_text(toml)
    code, _, err = cli(["run", str(path), "--out", str(tmp_path / "out"), "--no-report"], capsys)
    assert code == 2 and not (tmp_path / "out").exists()
    line = refusal_text(err)
    assert words in line and "--" not in line.split(":")[0]
    if not toml:
        assert "is empty" in line


@pytest.mark.parametrize("command", ["run", "check"])
def test_an_empty_impl_is_an_error_not_everything(command, tmp_path, capsys):
    code, _, err = cli([command, "--impl", " ", *(["--out", str(tmp_path)] if command == "run" else [])], capsys)
    assert code == 2 and "--impl" in err and "is empty" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # builds a report (seconds of matplotlib)
def test_out_puts_the_report_beside_the_results(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [a for a in TINY if a not in ("--no-report", "-q")]
    code, out, _ = cli(["run", "--out", str(tmp_path / "mine"), *argv, "--impl", "sdpa"], capsys)
    run_dir = only_run(tmp_path / "mine")
    assert code == 0 and (run_dir / "report" / "report.html").is_file()
    assert not (tmp_path / "reports").exists()
    assert f"report:  {run_dir / 'report' / 'report.html'}" in out.replace("\n", "")


# --- report honesty ---------------------------------------------------------------------------------

def test_the_peak_is_the_best_of_its_tries_and_measured_again_on_request(monkeypatch):
    from attnbench.measure import flops

    measured = iter([50.0, 180.0, 120.0])
    monkeypatch.setattr(flops, "_best_peaks", {})
    monkeypatch.setattr(flops, "_measure_peak_gflops", lambda device, dtype, budget_s, floor=0.0: next(measured))
    assert flops.peak_gflops("cpu", "float32") == 50.0
    assert flops.peak_gflops("cpu", "float32") == 50.0  # once per process
    assert flops.peak_gflops("cpu", "float32", again=True) == 180.0
    assert flops.peak_gflops("cpu", "float32", again=True) == 180.0  # the best is kept


@pytest.mark.slow  # measures a cell in this process
def test_a_cell_faster_than_the_peak_measures_it_again_and_says_so(monkeypatch):
    from attnbench.measure import flops
    from attnbench.results.schema import Cell
    from attnbench.runner.cell import run_cell
    from attnbench.runner.sweep import Settings

    monkeypatch.setattr(flops, "_best_peaks", {})
    monkeypatch.setattr(flops, "_measure_peak_gflops", lambda device, dtype, budget_s, floor=0.0: 2e-6)
    cell = Cell("sdpa", batch=1, seq_len=16, num_heads=2, d_model=16, mode="forward")
    row = run_cell(cell, Settings(budget_s=0.02, warmup_s=0.0, min_samples=3, flop_check=False), peak_gflops_per_s=1e-6)
    assert row["status"] == "ok" and row["peak_gflops_per_s"] == 2e-6  # measured again, the better one kept
    assert row["frac_peak"] > 1 and "exceeds the peak GEMM measured here" in row["notes"]


@pytest.mark.slow  # builds a report
def test_report_counts_like_the_console_and_skipped_cells_are_not_failures(tmp_path):
    from attnbench.report import build_report
    from attnbench.results.quality import flag_counts
    from attnbench.results.schema import Cell
    from attnbench.results.store import RunStore

    run = synthetic_run(tmp_path, impls=("sdpa", "weight_split"), seq_lens=(32, 64), failures=False, noisy=False,
                        run_id="honest")
    with RunStore(run, resume=True) as store:
        store.rewrite_cells(lambda r: {**r, "contended": "yes"} if r["seq_len"] == 64 else None)
        store.rewrite_cells(lambda r: {**r, "frac_peak": 1.3} if r["impl"] == "sdpa" and r["seq_len"] == 32 else None)
        store.append(failed_row(Cell("sdpa", seq_len=32, num_heads=3, d_model=64, mode="forward"), "skipped",
                                "d_model=64 is not divisible by num_heads=3"))
        store.finalize()
    df, _ = load_run(run)
    counts = flag_counts(df)
    assert counts == {"noisy": 0, "unstable": 0, "contended": 2}
    html = build_report(run, out_dir=tmp_path / "rep").read_text()
    assert "<b>0</b>failed" in html and "<b>1</b>skipped" in html and "not ok" not in html
    assert ">0</b>noisy" in html and ">2</b>contended" in html
    assert "ran faster than the peak GEMM measured" in html and "× ahead of" not in html


@pytest.mark.parametrize(("ratio", "text"), [("1", "level with sdpa (within 1%)"), (1.004, "level with sdpa (within 1%)"),
                                             ("1.43", "1.43× as fast as sdpa"), ("12.3", "12.30× as fast as sdpa")])
def test_speed_up_wording_is_numeric_and_never_one_times_ahead(ratio, text):
    from attnbench.results.text import fmt_lead

    assert fmt_lead(ratio, "sdpa") == text


def test_console_marks_a_fraction_of_peak_over_100_percent_and_explains_it(tmp_path, capsys):
    from attnbench.cli import run as run_cli

    run = synthetic_run(tmp_path, impls=("sdpa",), seq_lens=(32,), failures=False, run_id="over")
    df, _ = load_run(run)
    df.loc[0, "frac_peak"] = 1.3
    run_cli.console.print(run_cli.summary_table(df, "t"))
    run_cli._print_over_peak(df)
    out = capsys.readouterr().out
    assert "130%*" in out and "ran faster than the peak GEMM measured in this run" in out


# --- issue 45: the closing line names the first failed cell, not the first skipped one -------------------------

def test_closing_line_names_the_first_failed_cell_after_skipped_ones():
    import pandas as pd

    from attnbench.cli.run import failure_line
    from attnbench.results.schema import Cell

    ok, skipped, error = Cell("sdpa", seq_len=16), Cell("sdpa", seq_len=16, num_kv_heads=1), Cell("wrapper", seq_len=16)
    df = pd.DataFrame([{"cell_id": ok.cell_id, "status": "ok", "error": ""},
                       {"cell_id": skipped.cell_id, "status": "skipped", "error": "does not support grouped-query"},
                       {"cell_id": error.cell_id, "status": "error", "error": "RuntimeError: boom"}])
    line = failure_line(df)
    assert line.startswith("1 of 3 cells failed (1 error)")
    assert line.endswith(f"; first: {error.cell_id}: error: RuntimeError: boom")
    assert "skipped" not in line


def test_closing_line_of_a_run_with_nothing_measured_still_names_a_cell():
    import pandas as pd

    from attnbench.cli.run import failure_line

    df = pd.DataFrame([{"cell_id": "a", "status": "skipped", "error": "needs CUDA"}])
    assert failure_line(df) == "no cell was measured (1 skipped); first: a: skipped: needs CUDA"


def test_run_closing_line_skips_past_skipped_cells_to_the_error(tmp_path, capsys):
    # neither declares grouped-query attention: the kv1 group (first, as --kv-heads orders it) is two skipped rows
    # ahead of the mha group's error row
    code, _, err = cli(["run", "--out", str(tmp_path), *TINY, "--kv-heads", "1,mha",
                        "--impl", f"sdpa,{PLUGINS / 'faulty.py'}:Raises"], capsys)
    df, _ = load_run(only_run(tmp_path))
    assert code == 1 and "skipped" in set(df.status) and "error" in set(df.status)
    (line,) = error_lines(err)
    first = line.split("; first: ", 1)[1]
    assert first.startswith(f"{df[df.status == 'error'].cell_id.iloc[0]}: error:") and "deliberate failure" in first
