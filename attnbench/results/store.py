"""The results store: a run folder written cell by cell, read back as one DataFrame.

Layout of ``<out>/<run_id>/``::

    meta.json            run metadata (environment, command line, sweep) — written first, then updated in place
    .lock                the writer's lock (attnbench.results.lock): one process writes a run at a time
    cells/00012.parquet  one file per finished cell, written atomically (tmp + rename)
    results.parquet      all cells, consolidated when the run ends (also after Ctrl-C)
    results.csv          the same, without raw samples, on request

A run killed at any point keeps every finished cell in ``cells/``; :func:`load_run` reads them
whether or not ``results.parquet`` was written, and ``--resume`` skips their ``cell_id``. A folder kept or shared
as ``results.parquet`` plus ``meta.json`` alone reads the same (rows of ``results.parquet`` whose cell is not in
``cells/`` are added). Every write is atomic and fails as one line (:mod:`attnbench.results.write_errors`).

One row per cell, always: should ``cells/`` hold two files for one cell (two writers before the run lock
existed, or a crash between a cell's write and its bookkeeping), :func:`load_run` keeps the complete one
(:func:`drop_duplicate_cells`) and consolidation moves the other to ``cells/duplicates/`` and says so.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import sys
import warnings
from datetime import datetime
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from attnbench.errors import OlderResultsWarning, ResultsError
from attnbench.results.lock import RUN_LOCK_NAME, lock_run
from attnbench.results.schema import COLUMNS, SCHEMA_VERSION, check_row, fill_added_columns
from attnbench.results.write_errors import atomic_write, make_dirs

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
    """Writes one run folder, holding its lock (:func:`attnbench.results.lock.lock_run`) until :meth:`close`.

    A second ``RunStore`` on the same folder, in any process, raises
    :class:`~attnbench.results.lock.RunLockedError` naming the holder; a lock left by a process of this host
    that died is taken over, with a note on stderr and in ``meta.json`` (``lock_takeovers``).
    """

    def __init__(self, root: str | Path, run_id: str | None = None, meta: dict | None = None, resume: bool = False):
        self.root = Path(root)
        if resume:
            self.path = self.root
            meta_file = self.path / "meta.json"
            if not meta_file.is_file():
                raise ResultsError(f"cannot resume {self.path}: no meta.json there, so it is not an attnbench run "
                                   "folder; pass the folder `attnbench run` printed (results/<run-id>)")
            read_meta(self.path)  # a foreign or corrupt folder is refused before anything (even the lock) is written
            load_run(self.path)  # validates every cell file
            self._lock = lock_run(self.path, purpose=f"attnbench run writing {self.path}")
            try:
                self.meta = read_meta(self.path)  # again, under the lock: as the last writer left it
                self.run_id = self.meta["run_id"]
            except BaseException:
                self.close()
                raise
        else:
            self.run_id = run_id or new_run_id()
            self.path = self.root / self.run_id
            make_dirs(self.path)
            # the lock first, then the check: two processes given one --run-id cannot both find it empty
            self._lock = lock_run(self.path, purpose=f"attnbench run writing {self.path}")
            if any(p.name != RUN_LOCK_NAME for p in self.path.iterdir()):
                self.close()
                raise ResultsError(f"{self.path} already exists and is not empty; pick another --out or use --resume")
            self.meta = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "run_id": self.run_id, **(meta or {})}
        self._meta_base: dict = {}  # meta.json as this process last read or wrote it (what its changes are against)
        if resume:
            self._meta_base = _json_copy(self.meta)
        note = self._lock.takeover_note()
        if note:
            print(f"note: {self.path}: {note}", file=sys.stderr)
            self.meta["lock_takeovers"] = [*self.meta.get("lock_takeovers", []), note]
        make_dirs(self.path / "cells", self.path)
        # cell files are numbered by a counter, not by listing cells/ for every row (O(1) per append)
        numbers = [int(f.name[:5]) for f in (self.path / "cells").glob("*.parquet") if f.name[:5].isdigit()]
        self._next_index = max(numbers, default=-1) + 1
        self.write_meta()

    def close(self) -> None:
        """Release the run folder's lock (the run can then be resumed); safe to call twice."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write_meta(self) -> None:
        """Update ``meta.json`` in place: read it, apply the keys this process changed since it last read or
        wrote it, write it atomically. Keys another writer added meanwhile survive; nothing is overwritten with
        this process's stale view of them."""
        on_disk = read_meta(self.path) if (self.path / "meta.json").is_file() else {}
        mine = _json_copy(self.meta)
        for key in set(mine) | set(self._meta_base):
            if key not in mine:
                on_disk.pop(key, None)
            elif key not in self._meta_base or mine[key] != self._meta_base[key]:
                on_disk[key] = mine[key]
        _atomic_write_bytes(self.path / "meta.json", json.dumps(on_disk, indent=2, default=str).encode())
        self._meta_base = _json_copy(on_disk)
        self.meta.clear()
        self.meta.update(copy.deepcopy(on_disk))

    def done_cell_ids(self) -> set[str]:
        """``cell_id`` of every cell already written (for ``--resume``)."""
        df = load_run(self.path)[0]
        return set(df["cell_id"]) if len(df) else set()

    def append(self, row: dict) -> Path:
        """Write one finished cell; it survives anything that happens afterwards."""
        cells = self.path / "cells"
        index, self._next_index = self._next_index, self._next_index + 1
        target = cells / f"{index:05d}-{secrets.token_hex(3)}.parquet"
        atomic_write(target, lambda tmp: pq.write_table(_table([{**row, "run_id": self.run_id}]), tmp), self.path)
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
        atomic_write(path, lambda tmp: pq.write_table(_table([{**row, "run_id": self.run_id}]), tmp), self.path)

    def consolidate(self, csv: bool = False) -> pd.DataFrame:
        """Read ``cells/`` once, write it as ``results.parquet`` (and ``results.csv``), and return it.

        One row per cell: a duplicate cell file is moved to ``cells/duplicates/`` (kept, never deleted), said on
        stderr and listed in ``meta.json`` (``dropped_duplicates``)."""
        df, _ = load_run(self.path)
        dropped = df.attrs.get("dropped_duplicates") or []
        if dropped:
            aside = self.path / "cells" / "duplicates"
            aside.mkdir(exist_ok=True)
            for d in dropped:
                src = self.path / "cells" / d["file"]
                if src.exists():
                    os.replace(src, aside / d["file"])
                print(f"note: {self.path}: two rows for {d['cell_id']}: kept {d['kept']}, dropped {d['file']} "
                      f"({d['why']}; moved to cells/duplicates/)", file=sys.stderr)
            self.meta["dropped_duplicates"] = [*self.meta.get("dropped_duplicates", []), *dropped]
            self.write_meta()
        out = self.path / "results.parquet"
        atomic_write(out, lambda tmp: pq.write_table(_table(df.to_dict("records")), tmp), self.path)
        if csv:
            atomic_write(self.path / "results.csv", lambda tmp: df.drop(columns=["samples_s"]).to_csv(tmp, index=False),
                         self.path)
        return df

    def finalize(self, csv: bool = False) -> Path:
        """Consolidate ``cells/`` into ``results.parquet`` (and ``results.csv``); returns the parquet path."""
        self.consolidate(csv)
        return self.path / "results.parquet"


def _json_copy(value: dict) -> dict:
    """``value`` as it reads back from JSON (so that comparing with what is on disk compares like with like)."""
    return json.loads(json.dumps(value, default=str))


def _completeness(row: dict) -> tuple:
    """How complete a cell's row is, for choosing between two rows of one cell: a timed (ok) row beats a
    failed one, more rounds merged beat fewer, more samples beat fewer, and then the later row wins."""
    groups = row.get("sample_groups")
    n_groups = len(groups) if groups is not None and not isinstance(groups, str | float) else 0
    n = row.get("n")
    return (row.get("status") == "ok", n_groups, 0 if n is None or n != n else int(n), str(row.get("started_at") or ""))


def drop_duplicate_cells(df: pd.DataFrame, files: list[str]) -> tuple[pd.DataFrame, list[dict]]:
    """``df`` (row i read from ``files[i]``) with one row per ``cell_id``: the complete one (:func:`_completeness`),
    and what was dropped: ``{"cell_id", "file", "kept", "why"}`` per dropped row."""
    if not len(df) or not df["cell_id"].duplicated().any():
        return df, []
    keep, dropped = [], []
    for cell_id, idx in df.groupby("cell_id", sort=False).groups.items():
        idx = list(idx)
        if len(idx) == 1:
            keep.append(idx[0])
            continue
        rows = {i: df.loc[i].to_dict() for i in idx}
        best = max(idx, key=lambda i: (_completeness(rows[i]), i))
        keep.append(best)
        for i in idx:
            if i != best:
                r, b = rows[i], rows[best]
                why = (f"status {r.get('status')} vs {b.get('status')}" if r.get("status") != b.get("status") else
                       f"{_completeness(r)[1]} round group(s) and {_completeness(r)[2]} samples vs "
                       f"{_completeness(b)[1]} and {_completeness(b)[2]}")
                dropped.append({"cell_id": str(cell_id), "file": files[i], "kept": files[best], "why": why})
    out = df.loc[sorted(keep)].reset_index(drop=True)
    out.attrs = dict(df.attrs)
    return out, dropped


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data), path.parent)


def the_run(path: str | Path) -> Path:
    """``path`` itself when it is a run (a run folder, or a results file); a folder that only holds one run folder
    (``--out r1`` writes ``r1/<run-id>/``): that run; a folder of several runs: a :class:`ResultsError` naming them."""
    p = Path(path)
    if not p.is_dir() or (p / "meta.json").exists() or (p / "results.parquet").exists():
        return p
    runs = sorted(d for d in p.iterdir() if d.is_dir() and (d / "meta.json").exists())
    if len(runs) == 1:
        return runs[0]
    if runs:
        shown = ", ".join(str(d) for d in runs[:6]) + (" ..." if len(runs) > 6 else "")
        raise ResultsError(f"{p} holds {len(runs)} runs ({shown}); name one of them")
    return p  # neither a run nor a folder of runs: load_run / read_meta say so


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


def write_meta_keys(path: str | Path, **keys) -> None:
    """Set ``keys`` in the ``meta.json`` of the finished run folder ``path`` (under the folder's lock; the rest of the
    file as it is): what is known only after the run, e.g. the report's time (issue 30)."""
    folder = Path(path)
    lock = lock_run(folder, purpose=f"attnbench updating {folder / 'meta.json'}")
    try:
        meta = read_meta(folder)
        meta.update(_json_copy(keys))
        _atomic_write_bytes(folder / "meta.json", json.dumps(meta, indent=2, default=str).encode())
    finally:
        lock.release()


def load_run(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """Read a run (its folder, or a ``results.parquet``/``.csv`` file) as ``(DataFrame, meta)``.

    Cells written after the last consolidation are included; a cell file that does not parse or
    lacks columns raises :class:`ResultsError` naming it. One row per cell: duplicates are left out
    (:func:`drop_duplicate_cells`; what was left out is in ``df.attrs["dropped_duplicates"]``).
    """
    p = Path(path)
    if not p.exists():
        raise ResultsError(f"results path {p} does not exist")
    if p.is_file():
        folder = p.parent
        meta = read_meta(folder) if (folder / "meta.json").exists() else {}
        frames = [_read_one(p)]
        names = [f"{p.name} row {i}" for i in range(len(frames[0]))]
    else:
        meta = read_meta(p)
        files = sorted((p / "cells").glob("*.parquet"))
        frames, names = _read_cells(files)
        kept = _consolidated_rows(p, {c for f in frames for c in f["cell_id"]})
        if kept is not None:  # a folder kept or shared as results.parquet + meta.json (cells/ gone or partial)
            frames.append(kept)
            names += [f"results.parquet row {i}" for i in range(len(kept))]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=k if k != "string" else "string") for c, k in COLUMNS.items()}), meta
    df = pd.concat(frames, ignore_index=True)
    filled = sorted({c for f in frames for c in f.attrs.get("filled_columns", ())})
    df.attrs["filled_columns"] = filled
    if filled:
        version = meta.get("schema_version", 1) if meta else "unknown"
        df.attrs["schema_note"] = (f"results written with row schema {version} (this attnbench writes "
                                   f"{SCHEMA_VERSION}); filled in: {', '.join(filled)}")
        warnings.warn(f"{path}: {df.attrs['schema_note']}", OlderResultsWarning, stacklevel=2)
    df, dropped = drop_duplicate_cells(df, names)
    if dropped:
        df.attrs["dropped_duplicates"] = dropped
    return df, meta


def _consolidated_rows(folder: Path, in_cells: set) -> pd.DataFrame | None:
    """The rows of ``folder/results.parquet`` whose cell is not in ``cells/`` (None: none, or no such file), so a
    run folder reads the same from either form it is kept in, and a partial ``cells/`` loses no row."""
    whole = folder / "results.parquet"
    if not whole.is_file():
        return None
    df = _read_one(whole)
    df = df[~df["cell_id"].isin(in_cells)].reset_index(drop=True)
    return df if len(df) else None


def _read_cells(files: list[Path]) -> tuple[list[pd.DataFrame], list[str]]:
    """The cell files as frames, and the file each row came from. Files of one schema (a run's, always) are
    converted to pandas once, together: converting 72 one-row tables one by one cost most of a second."""
    tables = [_read_arrow(f) for f in files]
    names = [f.name for f, t in zip(files, tables, strict=True) for _ in range(t.num_rows)]
    first = tables[0].schema if tables else None  # attnbench writes no pandas metadata (no index to rebuild per file)
    if len(tables) > 1 and first.metadata is None and all(t.schema.equals(first, check_metadata=True) for t in tables):
        frame = _checked_frame(pa.concat_tables(tables).to_pandas(), files[0])
        if frame is not None:
            return [frame], names
    return [_checked_frame(t.to_pandas(), f, strict=True) for f, t in zip(files, tables, strict=True)], names


def _read_arrow(f: Path) -> pa.Table:
    try:
        return pq.ParquetFile(f).read(use_threads=False)  # a one-row file: threads and datasets only add overhead
    except Exception as exc:
        raise ResultsError(f"{f} is not a readable results file ({type(exc).__name__}: {exc}); "
                           "move it away or start a new run") from exc


def _read_one(f: Path) -> pd.DataFrame:
    if f.suffix != ".csv":
        return _checked_frame(_read_arrow(f).to_pandas(), f, strict=True)
    try:
        df = pd.read_csv(f)
    except Exception as exc:
        raise ResultsError(f"{f} is not a readable results file ({type(exc).__name__}: {exc}); "
                           "move it away or start a new run") from exc
    return _checked_frame(df, f, strict=True)


def _checked_frame(df: pd.DataFrame, f: Path, strict: bool = False) -> pd.DataFrame | None:
    """``df`` read from ``f`` with the columns of older rows filled in and samples as lists of floats; a frame
    lacking required columns raises naming ``f`` (``strict``) or is None (the caller reads file by file)."""
    filled = fill_added_columns(df).attrs["filled_columns"]
    df.attrs["filled_columns"] = [c for c in filled if not (c == "samples_s" and f.suffix == ".csv")]
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing and not strict:
        return None
    if missing:
        raise ResultsError(f"{f} is not an attnbench results file: missing columns {missing[:5]}")
    if "samples_s" in df.columns:
        df["samples_s"] = df["samples_s"].apply(lambda v: [float(x) for x in v] if v is not None and not isinstance(v, str) else [])
    return df
