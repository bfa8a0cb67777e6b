"""Writing a run folder failed (unwritable, read-only, full disk): one line that names the path, the cause and the fix.

Every write of the store goes through :func:`atomic_write`: a temporary file beside the target, renamed over it, and
removed when the write fails, so a failed write leaves the folder as it was (no ``*.tmp``, no half-written file).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from pathlib import Path

from attnbench.errors import ResultsError


class ResultsWriteError(ResultsError):
    """The results could not be written (a :class:`ResultsError`: the CLI prints it as one line, exit 2)."""


def _errno(exc: OSError) -> int | None:
    """The error number, also from pyarrow's errors, which carry it only in the message (``[errno 28] ...``)."""
    if exc.errno is not None:
        return exc.errno
    match = re.search(r"\[errno (\d+)\]", str(exc), re.IGNORECASE)
    return int(match.group(1)) if match else None


def write_error(exc: OSError, path: Path, run_dir: Path | None = None) -> ResultsWriteError:
    """The one-line error for ``exc`` raised writing ``path``; ``run_dir``: the run it belongs to, if it exists."""
    code = _errno(exc)
    kept = (f"; every finished cell is kept in {run_dir / 'cells'}" if run_dir is not None and (run_dir / "cells").is_dir()
            else "")
    if code in (errno.ENOSPC, errno.EDQUOT):
        fix = (f"free some space, then `attnbench run --resume {run_dir}` completes the run" if run_dir is not None
               else "free some space or choose another --out")
        return ResultsWriteError(f"the disk is full writing {path} ({os.strerror(code)}){kept}; {fix}")
    if code == errno.EROFS:
        return ResultsWriteError(f"cannot write {path}: the filesystem is read-only{kept}; choose another --out")
    if code in (errno.EACCES, errno.EPERM):
        return ResultsWriteError(f"cannot write {path}: permission denied{kept}; choose another --out "
                                 "(a folder you can write)")
    if code in (errno.ENOTDIR, errno.EEXIST) and not path.is_dir():
        return ResultsWriteError(f"cannot write {path}: a file is in the way of the folder{kept}; choose another --out")
    return ResultsWriteError(f"cannot write {path}: {exc.strerror or exc}{kept}; check the folder or choose another --out")


def atomic_write(target: Path, write: Callable[[Path], object], run_dir: Path | None = None) -> None:
    """``write(tmp)`` then rename ``tmp`` over ``target``; on an ``OSError`` the temporary file is removed and a
    :class:`ResultsWriteError` raised (``target`` untouched)."""
    tmp = target.with_suffix(target.suffix + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(exc, ResultsError):
            raise
        raise write_error(exc, target, run_dir) from exc


def make_dirs(path: Path, run_dir: Path | None = None) -> None:
    """``mkdir -p path``, a :class:`ResultsWriteError` when it cannot be made."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(exc, path, run_dir) from exc
