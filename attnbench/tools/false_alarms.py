"""False-alarm check of the correctness matrix: correct implementations over many consecutive seeds.

Run it as a script (a statistical check, not a unit test)::

    python -m attnbench.tools.false_alarms [--seeds 20] [--first 0] [--impl NAME ...] [--kind KIND ...] [--device cpu]

Every case draws other weights and inputs for each seed (``run_matrix(seed=...)``), so a tolerance
or a statistical bound that holds for the fixed matrix only shows up here. Default implementations:
every built-in available on the device plus the correct test plug-ins, when run from the repository
root. Prints each flagged case and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from attnbench import registry
from attnbench.correctness.matrix import run_matrix

CORRECT_PLUGINS = ("tests/plugins/good.py:PlainAttention", "tests/plugins/good.py:SDPAAttention",
                   "tests/plugins/buggy.py:Baseline", "tests/plugins/buggy_round2.py:Baseline")
"""Correct classes written outside the package (used when their files exist under the working directory)."""


def correct_implementations(device: str = "cpu") -> list[str]:
    """Built-ins available on ``device`` and the correct test plug-ins found from the working directory."""
    return registry.available(device) + [p for p in CORRECT_PLUGINS if Path(p.split(":")[0]).is_file()]


def false_alarms(impls: list[str], seeds: range, kinds: list[str] | None = None, device: str = "cpu") -> pd.DataFrame:
    """Every case of ``impls`` for each seed; the failed and errored rows, with a ``seed`` column."""
    flagged = []
    for seed in seeds:
        df = run_matrix(impls, device=device, kinds=kinds, seed=seed)
        flagged.append(df[df.status.isin(["fail", "error"])].assign(seed=seed))
    return pd.concat(flagged, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="number of consecutive seeds (default 20)")
    parser.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--impl", action="append", help="implementation (repeatable; default: every correct one)")
    parser.add_argument("--kind", action="append", help="case kind (repeatable; default: all)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    impls = args.impl or correct_implementations(args.device)
    bad = false_alarms(impls, range(args.first, args.first + args.seeds), args.kind, args.device)
    for r in bad.itertuples():
        print(f"seed {r.seed}: {r.status} {r.impl} {r.kind} {r.shape} {r.dtype}: {r.message}")
    print(f"{len(bad)} false alarm(s) over {args.seeds} seeds x {len(impls)} implementations")
    return 1 if len(bad) else 0


if __name__ == "__main__":
    sys.exit(main())
