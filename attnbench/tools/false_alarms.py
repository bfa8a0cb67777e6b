"""False-alarm check of the correctness matrix: correct implementations over many consecutive seeds.

Run it as a script (a statistical check, not a unit test)::

    python -m attnbench.tools.false_alarms [--seeds 20] [--first 0] [--impl NAME ...] [--also NAME ...]
                                           [--kind KIND ...] [--device cpu]

Every case draws other weights and inputs for each seed (``run_matrix(seed=...)``), so a tolerance
or a statistical bound that holds for the fixed matrix only shows up here. Implementations: ``--impl``
(repeatable), else every built-in available on the device; ``--also`` adds correct classes written
elsewhere (``file.py:Class``), e.g. the test suite's correct plug-ins::

    python -m attnbench.tools.false_alarms --also tests/plugins/good.py:PlainAttention --also tests/plugins/modern.py:FusedNoBias

Prints each flagged case and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable

import pandas as pd

from attnbench import registry
from attnbench.correctness.matrix import run_matrix


def correct_implementations(device: str = "cpu", plugins: Iterable[str] = ()) -> list[str]:
    """Built-ins available on ``device``, then ``plugins`` (correct classes written elsewhere, as ``--impl`` names them)."""
    return registry.available(device) + [p for p in plugins if p not in registry.available(device)]


def false_alarms(impls: list[str], seeds: range, kinds: list[str] | None = None, device: str = "cpu",
                 run: Callable[..., pd.DataFrame] = run_matrix) -> pd.DataFrame:
    """Every case of ``impls`` for each seed; the failed and errored rows, with a ``seed`` column.

    ``run`` is :func:`~attnbench.correctness.matrix.run_matrix` or a function with its signature (a test's cache).
    """
    flagged = []
    for seed in seeds:
        df = run(impls, device=device, kinds=kinds, seed=seed)
        flagged.append(df[df.status.isin(["fail", "error"])].assign(seed=seed))
    return pd.concat(flagged, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="number of consecutive seeds (default 20)")
    parser.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--impl", action="append", help="implementation (repeatable; default: every built-in available)")
    parser.add_argument("--also", action="append", default=[],
                        help="a correct class written elsewhere, added to the implementations (repeatable; file.py:Class)")
    parser.add_argument("--kind", action="append", help="case kind (repeatable; default: all)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.impl:
        impls = args.impl + [p for p in args.also if p not in args.impl]
    else:
        impls = correct_implementations(args.device, args.also)
    bad = false_alarms(impls, range(args.first, args.first + args.seeds), args.kind, args.device)
    for r in bad.itertuples():
        print(f"seed {r.seed}: {r.status} {r.impl} {r.kind} {r.shape} {r.dtype}: {r.message}")
    print(f"{len(bad)} false alarm(s) over {args.seeds} seeds x {len(impls)} implementations")
    return 1 if len(bad) else 0


if __name__ == "__main__":
    sys.exit(main())
