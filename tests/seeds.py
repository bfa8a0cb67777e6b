"""How many seeds the slow set's false-alarm sweeps draw (tests/test_properties.py, tests/test_context.py)."""

from __future__ import annotations

import os

FALSE_ALARM_SEEDS = int(os.environ.get("ATTNBENCH_FALSE_ALARM_SEEDS", "2"))
"""2 in CI, whose time these sweeps dominated (at 20 seeds they took 1300 of two workers' 2640 s on 2026-12-03, and
the slow set 22 minutes; at 4, the whole of CI took 29.7 of its 30 minutes on 2026-12-03);
``ATTNBENCH_FALSE_ALARM_SEEDS=20 python -m pytest -m slow -k false_alarm`` runs the full sweep
(20 seeds, 0 false alarms, measured 2026-12-03), as does ``python -m attnbench.tools.false_alarms``."""
