"""Identical runs compared in pairs: does ``attnbench compare`` call unchanged code changed? (issue 39, item 3)

``python -m attnbench.tools.reproducibility --runs 20 --pairs`` runs one sweep 20 times in fresh processes (the
code does not change between them), then compares run 1 with run 2, run 3 with run 4, and so on, exactly as
``attnbench compare A B`` would (same threshold, alpha and between-run term). Every cell that reads anything but
"no significant change" is a false alarm of the wall-time layer; a cell past the threshold would fail a gate
(``attnbench compare --fail-on-regression`` or the asv gate's wall-time layer). The runs are consecutive, seconds
apart, as in the issue's report (two identical runs 11 s apart read 0.837x, p=0.0005, "faster").
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from attnbench.results.compare import INCONCLUSIVE, NO_VERDICT, compare_runs

QUIET = "no significant change"


def pair_verdicts(dirs: list[Path], threshold: float = 0.10, alpha: float = 0.05) -> pd.DataFrame:
    """One row per cell and pair of consecutive runs (1 vs 2, 3 vs 4, ...): the ratio B/A, its CI and p-value, the
    verdict ``compare`` gives, whether it is a false alarm (any verdict but :data:`QUIET` and ``inconclusive``: timed under
    other load, which ``compare`` reports but counts as no verdict) and whether it would fail
    a gate (a regression or improvement past ``threshold``)."""
    rows = []
    for k in range(0, len(dirs) - 1, 2):
        result = compare_runs(dirs[k], dirs[k + 1], threshold=threshold, alpha=alpha)
        for r in result.cells.to_dict("records"):
            rows.append({"pair": k // 2 + 1, "impl": r["impl"], "seq_len": r["seq_len"], "mode": r["mode"],
                         "ratio": r["ratio"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                         "p_value": r["p_value"], "change": r["change"],
                         "inconclusive": str(r["change"]).startswith(INCONCLUSIVE),
                         "false_alarm": r["change"] != QUIET and not str(r["change"]).startswith(INCONCLUSIVE)
                         and not str(r["change"]).endswith(NO_VERDICT),
                         "gate_fails": bool(r["regression"] or r["improvement"])})
    return pd.DataFrame(rows)


def summarise_pairs(verdicts: pd.DataFrame) -> dict:
    """How many pairs and cells read significant, and the widest ratio seen between two identical runs."""
    if verdicts.empty:
        return {"pairs": 0, "cells": 0, "inconclusive": 0, "false_alarms": 0, "pairs_with_alarm": 0, "gate_failures": 0,
                "max_ratio_dev": float("nan")}
    dev = (verdicts["ratio"].apply(lambda r: max(r, 1 / r)) - 1).max()
    return {"pairs": int(verdicts["pair"].nunique()), "cells": int(len(verdicts)),
            "inconclusive": int(verdicts["inconclusive"].sum()),
            "false_alarms": int(verdicts["false_alarm"].sum()),
            "pairs_with_alarm": int(verdicts.groupby("pair")["false_alarm"].any().sum()),
            "gate_failures": int(verdicts["gate_fails"].sum()), "max_ratio_dev": float(dev)}


def print_pairs(verdicts: pd.DataFrame, summary: dict) -> None:
    if len(verdicts):
        print(verdicts.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"identical pairs: {summary['pairs']} pairs x cells = {summary['cells']} comparisons; "
          f"{summary['false_alarms']} read significant ({summary['pairs_with_alarm']} pair(s) with one or more), "
          f"{summary['gate_failures']} past the threshold (a gate failure), {summary['inconclusive']} inconclusive "
          f"(timed under other load: not counted); widest ratio between identical runs "
          f"{100 * summary['max_ratio_dev']:.1f}%")
