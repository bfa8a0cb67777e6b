"""Reports of a run: figures, analysis in words and tables, one self-contained HTML page.

    from attnbench.report import build_report
    build_report("results/20250101-120000-abcd")      # -> reports/20250101-120000-abcd/report.html
"""

from __future__ import annotations

from attnbench.report.page import build_report

__all__ = ["build_report"]
