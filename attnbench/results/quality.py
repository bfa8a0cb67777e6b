"""How many timed cells are noisy, unstable or contended: one count, shared by the console summary and the report.

* ``noisy``: the within-run CI half-width (``ci_within_rel``, before the between-run term; ``ci_rel`` in older runs)
  exceeds :data:`NOISY_CI_REL` of the median;
* ``unstable``: the samples have two modes (``stability``);
* ``contended``: other processes or the hypervisor took the CPUs while the cell was timed (``contended``).

A cell can be several of these; each count is of ok cells only.
"""

from __future__ import annotations

import pandas as pd

NOISY_CI_REL = 0.05
"""A cell whose within-run CI half-width exceeds this fraction of its median is noisy."""


def noise_rel(df: pd.DataFrame) -> pd.Series:
    """The within-run CI half-width as a fraction of the median (``ci_rel`` where the run did not record it)."""
    within = df["ci_within_rel"] if "ci_within_rel" in df else pd.Series(float("nan"), index=df.index)
    return within.where(within.notna(), df["ci_rel"])


def flag_masks(df: pd.DataFrame, limit: float = NOISY_CI_REL) -> dict[str, pd.Series]:
    """Boolean Series over ``df``: ok rows that are ``noisy``, ``unstable``, ``contended``."""
    ok = df["status"] == "ok"
    text = lambda col: df[col].astype(str) if col in df else pd.Series("", index=df.index)  # noqa: E731
    return {"noisy": ok & (noise_rel(df) > limit), "unstable": ok & (text("stability") == "unstable"),
            "contended": ok & (text("contended") == "yes")}


def flag_counts(df: pd.DataFrame, limit: float = NOISY_CI_REL) -> dict[str, int]:
    """``{"noisy": n, "unstable": n, "contended": n}`` of the ok cells of ``df``."""
    return {name: int(mask.sum()) for name, mask in flag_masks(df, limit).items()}
