"""Per-machine JSON files of measured facts (drift calibrations, roofline ceilings): read whole, one entry replaced
atomically, so that two processes writing at once never leave a torn file."""

from __future__ import annotations

import json
import os
from pathlib import Path


def load_entries(path: Path, error: type[Exception], what: str, fix: str) -> dict[str, dict]:
    """Every entry of the file at ``path`` ({} when there is none); a corrupt file is ``error`` naming it and ``fix``."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise error(f"cannot read the {what} {path}: {exc}; {fix}") from exc
    return data if isinstance(data, dict) else {}


def save_entry(path: Path, data: dict, key: str, entry: dict) -> Path:
    """``data`` (the file's entries) with ``entry`` under ``key``, written to ``path`` atomically; the path."""
    data[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path
