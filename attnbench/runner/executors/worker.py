"""``python -m attnbench.runner.executors.worker``: run one cell from a JSON payload on stdin, write its row as JSON.

Used by ``--isolate`` so that a crashing implementation takes down only this process.
"""

from __future__ import annotations

import json
import math
import sys

from attnbench.results.schema import Cell
from attnbench.runner.cell import run_cell
from attnbench.runner.sweep import Settings


def _jsonable(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def main() -> None:
    payload = json.loads(sys.stdin.read())
    row = run_cell(Cell(**payload["cell"]), Settings(**payload["settings"]), payload["run_id"],
                   peak_gflops_per_s=payload.get("peak_gflops_per_s"))
    row["worker"] = f"subprocess {row.get('worker', '')}".strip()
    with open(payload["out"], "w") as f:
        json.dump({k: _jsonable(v) for k, v in row.items()}, f)


if __name__ == "__main__":
    main()
