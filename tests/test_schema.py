"""The typed results row: unknown keys and wrong types fail with the key named; older runs say what was filled in."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from attnbench.errors import OlderResultsWarning, RowError
from attnbench.results.schema import COLUMNS, SCHEMA_VERSION, Cell, Row, check_row, empty_row, failed_row, fill_added_columns
from attnbench.results.store import RunStore, load_run

CELL = Cell("sdpa", "cpu", "float32", 1, 16, 2, 32, "inference")


def test_row_type_has_every_column_with_missing_values():
    row = Row()
    assert set(row.as_dict()) == set(COLUMNS)
    assert math.isnan(row.median_s) and row.error is None and row.n == 0
    assert Row.of({"median_s": 1e-3, "impl": "x"}).median_s == 1e-3


def test_misspelt_key_is_an_error_naming_it(tmp_path):
    row = empty_row(CELL, "r")
    row["meadian_s"] = 1.0
    with pytest.raises(RowError, match=r"'meadian_s' \(did you mean 'median_s'\?\)"):
        check_row(row)
    store = RunStore(tmp_path, run_id="r")
    with pytest.raises(RowError, match="meadian_s"):  # writing rejects it: the value is never silently dropped
        store.append(row)
    assert not list((store.path / "cells").glob("*.parquet"))


@pytest.mark.parametrize("key,value", [("median_s", "1 ms"), ("n", 2.5), ("causal", "yes"), ("samples_s", 3.0),
                                       ("impl", 3), ("median_s", True)])
def test_wrong_type_is_an_error_naming_the_key(key, value):
    with pytest.raises(RowError, match=repr(key)):
        check_row({**empty_row(CELL), key: value})


def test_failed_row_is_the_one_builder_of_failures():
    row = failed_row(CELL, "r", "timeout", "too slow", worker="w1", duration_s=2.0)
    assert row["status"] == "timeout" and row["error"] == "too slow" and row["worker"] == "w1"
    assert math.isnan(row["median_s"]) and row["cell_id"] == CELL.cell_id
    with pytest.raises(RowError, match="wroker"):
        failed_row(CELL, "r", "error", "x", wroker="w1")
    with pytest.raises(ValueError, match="failure status"):
        failed_row(CELL, "r", "ok", "")


def test_meta_records_the_schema_version_and_old_runs_say_what_was_filled(tmp_path):
    store = RunStore(tmp_path, run_id="new")
    row = empty_row(CELL, "new")
    row.update(status="ok", median_s=1e-3)
    store.append(row)
    assert json.loads((store.path / "meta.json").read_text())["schema_version"] == SCHEMA_VERSION
    df, _ = load_run(store.path)
    assert df.attrs["filled_columns"] == [] and "schema_note" not in df.attrs

    # an older run: no schema_version, and a cell file without the newer columns
    old = tmp_path / "old"
    (old / "cells").mkdir(parents=True)
    meta = {"format": "attnbench-results/1", "run_id": "old"}
    (old / "meta.json").write_text(json.dumps(meta))
    legacy = {k: v for k, v in row.items() if k not in ("num_kv_heads", "window", "causal", "drift_rel", "stability")}
    pd.DataFrame([legacy]).to_parquet(old / "cells" / "00000-aaaaaa.parquet")
    with pytest.warns(OlderResultsWarning, match="filled in: .*num_kv_heads"):
        df, _ = load_run(old)
    assert {"num_kv_heads", "window", "causal", "drift_rel", "stability"} <= set(df.attrs["filled_columns"])
    assert df.num_kv_heads[0] == df.num_heads[0] and bool(df.causal[0]) and math.isnan(df.window[0])
    assert "schema 1" in df.attrs["schema_note"] and "num_kv_heads" in df.attrs["schema_note"]


def test_fill_added_columns_keeps_the_public_signature():
    df = pd.DataFrame({"num_heads": [4], "median_s": [1.0]})
    assert fill_added_columns(df) is df and (df.num_kv_heads == 4).all()


def test_cells_of_one_schema_read_together_as_file_by_file_and_a_mixed_folder_still_reads(tmp_path):
    store = RunStore(tmp_path, run_id="r")
    for i, impl in enumerate(("sdpa", "einsum", "fused_qkv")):
        row = empty_row(Cell(impl, "cpu", "float32", 1, 16, 2, 32, "inference"), "r")
        row.update(status="ok", median_s=1e-3 * (i + 1), samples_s=[1e-3, 1e-3 * (i + 2)])
        store.append(row)
    together, _ = load_run(store.path)  # one schema: converted to pandas in one go
    files = sorted((store.path / "cells").glob("*.parquet"))
    one_by_one = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    assert together["cell_id"].tolist() == one_by_one["cell_id"].tolist()
    assert together["median_s"].tolist() == [1e-3, 2e-3, 3e-3]
    assert together["samples_s"].tolist() == [[1e-3, 2e-3], [1e-3, 3e-3], [1e-3, 4e-3]]
    assert together.attrs["filled_columns"] == []

    # a cell file of an older schema among them: read file by file, the old row filled in, no row lost
    legacy = {k: v for k, v in together.iloc[0].to_dict().items() if k not in ("num_kv_heads", "window")}
    legacy.update(cell_id="old|cell", group_id="old", samples_s=[5e-3])
    pd.DataFrame([legacy]).to_parquet(store.path / "cells" / "99999-old.parquet")
    with pytest.warns(OlderResultsWarning, match="num_kv_heads"):
        mixed, _ = load_run(store.path)
    assert len(mixed) == 4 and mixed["cell_id"].iloc[-1] == "old|cell"
    assert mixed["samples_s"].iloc[-1] == [5e-3] and mixed["num_kv_heads"].iloc[-1] == mixed["num_heads"].iloc[-1]
    store.close()
