"""Notebook results (attnbench.results.notebook): DataFrames that show the console's summary and draw the report's figures."""

from __future__ import annotations

import pandas as pd
import pytest
from sample_runs import synthetic_run

from attnbench.correctness.matrix import run_matrix
from attnbench.errors import ResultsError
from attnbench.results.notebook import CheckResults, Figures, RunResults
from attnbench.results.store import load_run


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    run = synthetic_run(tmp_path_factory.mktemp("nb"), impls=("weight_split", "sdpa"), seq_lens=(32, 64),
                        failures=True, paired="weight_split", run_id="nb-run")
    df, _ = load_run(run)
    df.attrs.update(run_dir=str(run), run_id="nb-run")
    return RunResults.of(df)


@pytest.mark.slow  # figures and the report page: ~10-30 s on a busy 2-core machine
def test_run_results_stay_dataframes_and_show_the_summary_with_speedups(results):
    assert isinstance(results, pd.DataFrame) and results.attrs["run_id"] == "nb-run"
    ok = results[results.status == "ok"]
    assert type(ok) is pd.DataFrame  # derived frames are plain DataFrames
    page = results._repr_html_()
    assert "attnbench run nb-run" in page and "speed-up vs weight_split" in page and "\x1b[" not in page
    assert results.headline() and results.headline()[0].startswith("sdpa: ") and "× vs weight_split" in results.headline()[0]
    assert "sdpa: " in page  # the headline is on the page
    failed = results[results.status != "ok"].iloc[0]
    assert failed["cell_id"] in page  # and the failed cells, with their status


@pytest.mark.slow
def test_plot_draws_the_report_figures_inline(results):
    for kind in ("speedup", "heatmap"):
        figs = results.plot(kind)
        assert isinstance(figs, Figures) and figs and all(f.data_uri and f.data_uri.startswith("data:image/png") for f in figs)
        assert figs._repr_html_().count("<img") == len(figs) and figs._repr_png_().startswith(b"\x89PNG")
    assert results.plot("heatmap")[0].kind == "heatmap"
    with pytest.raises(ResultsError, match="unknown plot 'speed'"):
        results.plot("speed")
    # results.report() (build_report on the run folder) runs in the quickstart notebook's test


def test_check_results_show_the_check_summary(single_thread, repo_cwd):
    bad = "tests/plugins/buggy.py:NoMask"
    res = CheckResults.of(run_matrix(["sdpa", bad], kinds=["causality"]))
    page = res._repr_html_()
    assert "correctness matrix on cpu" in page and "sdpa: PASS (1 passed, 0 skipped)" in page
    assert f"FAIL  {bad} causality props float64: outputs before position" in page
    assert type(res.head()) is pd.DataFrame


@pytest.mark.slow
def test_quickstart_notebook_executes_with_the_summary_and_a_figure(tmp_path):
    """examples/quickstart.ipynb, executed headless: the check's table, the run's summary, the heatmap."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from conftest import REPO

    nb = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pages = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("correctness matrix on cpu" in p and "mine: PASS" in p for p in pages)
    assert any("attnbench run" in p and "speed-up vs weight_split" in p and "mine: " in p for p in pages)
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)  # tqdm's notebook bar
    assert not [o for o in outputs if "\x1b[" in o.get("text", "")]  # no terminal escape codes
    assert list((tmp_path / "reports").glob("*/report.html"))  # results.report()
