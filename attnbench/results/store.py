"""The results store: a run folder written cell by cell, read back as one DataFrame.

Layout of ``<out>/<run_id>/``::

    meta.json            run metadata (environment, command line, sweep) — written first
    cells/00012.parquet  one file per finished cell, written atomically (tmp + rename)
    results.parquet      all cells, consolidated when the run ends (also after Ctrl-C)
    results.csv          the same, without raw samples, on request

A run killed at any point keeps every finished cell in ``cells/``; :func:`load_run` reads them
whether or not ``results.parquet`` was written, and ``--resume`` skips their ``cell_id``.
"""

from __future__ import annotations

import json
import os
import secrets
from datetime import datetime
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from attnbench.errors import ResultsError
from attnbench.results.schema import COLUMNS, SCHEMA_VERSION, check_row, fill_added_columns

FORMAT = "attnbench-results/1"


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-xxxx``: sortable, unique enough for one user's runs."""
    return datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


_ARROW_TYPES = {"object": pa.list_(pa.float64()), "string": pa.string(), "bool": pa.bool_(), "int64": pa.int64(),
                "float64": pa.float64()}


def _missing(v) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and v != v)


def _cell(kind: str, v):
    """One value as its column stores it: samples as a list of floats, a missing text as null, a missing flag as
    True, a missing count as 0, a missing number as NaN."""
    if kind == "object":
        return [] if v is None else [float(x) for x in v]
    if kind == "string":
        return None if _missing(v) else str(v)
    if kind == "bool":
        return True if _missing(v) else bool(v)
    if kind == "int64":
        return 0 if _missing(v) else int(v)
    return float("nan") if _missing(v) else float(v)


def _table(rows: list[dict]) -> pa.Table:
    """Rows as an Arrow table of :data:`COLUMNS` (each row checked first: an unknown key or a wrong type is a
    :class:`~attnbench.errors.RowError` naming it, never a silently dropped value). Built column by column
    from the values, without a DataFrame: appending one cell's row costs about a millisecond."""
    rows = [check_row(r) for r in rows]
    # from_pandas: NaN is stored as null, as pandas writes it, so other Parquet readers see missing values
    arrays = [pa.array([_cell(kind, r.get(name)) for r in rows], type=_ARROW_TYPES[kind], from_pandas=True)
              for name, kind in COLUMNS.items()]
    return pa.Table.from_arrays(arrays, schema=pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in COLUMNS.items()]))


class RunStore:
    """Writes one run folder; safe to use from one process at a time."""

    def __init__(self, root: str | Path, run_id: str | None = None, meta: dict | None = None, resume: bool = False):
        self.root = Path(root)
        if resume:
            self.path = self.root
            meta_file = self.path / "meta.json"
            if not meta_file.is_file():
                raise ResultsError(f"cannot resume {self.path}: no meta.json there, so it is not an attnbench run "
                                   "folder; pass the folder `attnbench run` printed (results/<run-id>)")
            self.meta = read_meta(self.path)
            self.run_id = self.meta["run_id"]
            load_run(self.path)  # validates every cell file before anything is written
        else:
            self.run_id = run_id or new_run_id()
            self.path = self.root / self.run_id
            if self.path.exists() and any(self.path.iterdir()):
                raise ResultsError(f"{self.path} already exists and is not empty; pick another --out or use --resume")
            self.meta = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "run_id": self.run_id, **(meta or {})}
        (self.path / "cells").mkdir(parents=True, exist_ok=True)
        self.write_meta()

    def write_meta(self) -> None:
        """(Re)write ``meta.json`` atomically."""
        _atomic_write_bytes(self.path / "meta.json", json.dumps(self.meta, indent=2, default=str).encode())

    def done_cell_ids(self) -> set[str]:
        """``cell_id`` of every cell already written (for ``--resume``)."""
        df = load_run(self.path)[0]
        return set(df["cell_id"]) if len(df) else set()

    def append(self, row: dict) -> Path:
        """Write one finished cell; it survives anything that happens afterwards."""
        cells = self.path / "cells"
        index = len(list(cells.glob("*.parquet")))
        target = cells / f"{index:05d}-{secrets.token_hex(3)}.parquet"
        tmp = target.with_suffix(".tmp")
        pq.write_table(_table([{**row, "run_id": self.run_id}]), tmp)
        os.replace(tmp, target)
        return target

    def rewrite_cells(self, fn) -> int:
        """Replace every written cell's row with ``fn(row)`` when that returns a dict (None: unchanged), each
        file atomically (a crash leaves every cell either as it was or rewritten); how many changed."""
        changed = 0
        for f in sorted((self.path / "cells").glob("*.parquet")):
            row = _read_one(f).to_dict("records")[0]
            new = fn(row)
            if new is not None:
                self.rewrite(f, new)
                changed += 1
        return changed

    def rewrite(self, path: Path, row: dict) -> None:
        """Replace the row of the cell file ``path`` (one written by :meth:`append`) atomically."""
        tmp = path.with_suffix(".tmp")
        pq.write_table(_table([{**row, "run_id": self.run_id}]), tmp)
        os.replace(tmp, path)

    def consolidate(self, csv: bool = False) -> pd.DataFrame:
        """Read ``cells/`` once, write it as ``results.parquet`` (and ``results.csv``), and return it."""
        df, _ = load_run(self.path)
        out = self.path / "results.parquet"
        tmp = out.with_suffix(".tmp")
        pq.write_table(_table(df.to_dict("records")), tmp)
        os.replace(tmp, out)
        if csv:
            df.drop(columns=["samples_s"]).to_csv(self.path / "results.csv", index=False)
        return df

    def finalize(self, csv: bool = False) -> Path:
        """Consolidate ``cells/`` into ``results.parquet`` (and ``results.csv``); returns the parquet path."""
        self.consolidate(csv)
        return self.path / "results.parquet"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_meta(path: str | Path) -> dict:
    """The ``meta.json`` of a run folder (a :class:`ResultsError` when missing or foreign)."""
    meta_file = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError as exc:
        raise ResultsError(f"{path} has no meta.json: not an attnbench run folder") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{meta_file} is corrupt ({exc}); it was not written by attnbench or was truncated") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "run_id" not in meta:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ResultsError(f"{meta_file} is not an attnbench results file (format {found!r}, expected {FORMAT!r})")
    return meta


def load_run(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """Read a run (its folder, or a ``results.parquet``/``.csv`` file) as ``(DataFrame, meta)``.

    Cells written after the last consolidation are included; a cell file that does not parse or
    lacks columns raises :class:`ResultsError` naming it.
    """
    p = Path(path)
    if not p.exists():
        raise ResultsError(f"results path {p} does not exist")
    if p.is_file():
        folder = p.parent
        meta = read_meta(folder) if (folder / "meta.json").exists() else {}
        frames = [_read_one(p)]
    else:
        meta = read_meta(p)
        files = sorted((p / "cells").glob("*.parquet"))
        frames = [_read_one(f) for f in files]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=k if k != "string" else "string") for c, k in COLUMNS.items()}), meta
    df = pd.concat(frames, ignore_index=True)
    filled = sorted({c for f in frames for c in f.attrs.get("filled_columns", ())})
    df.attrs["filled_columns"] = filled
    if filled:
        version = meta.get("schema_version", 1) if meta else "unknown"
        df.attrs["schema_note"] = (f"results written with row schema {version} (this attnbench writes "
                                   f"{SCHEMA_VERSION}); filled in: {', '.join(filled)}")
    return df, meta


def _read_one(f: Path) -> pd.DataFrame:
    try:
        df = pd.read_csv(f) if f.suffix == ".csv" else pq.read_table(f).to_pandas()
    except Exception as exc:
        raise ResultsError(f"{f} is not a readable results file ({type(exc).__name__}: {exc}); "
                           "move it away or start a new run") from exc
    filled = fill_added_columns(df).attrs["filled_columns"]
    df.attrs["filled_columns"] = [c for c in filled if not (c == "samples_s" and f.suffix == ".csv")]
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ResultsError(f"{f} is not an attnbench results file: missing columns {missing[:5]}")
    if "samples_s" in df.columns:
        df["samples_s"] = df["samples_s"].apply(lambda v: [float(x) for x in v] if v is not None and not isinstance(v, str) else [])
    return df
