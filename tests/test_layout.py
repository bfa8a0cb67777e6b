"""The package's shape: a few core modules at the top, and a light ``import attnbench``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attnbench

PACKAGE = Path(attnbench.__file__).resolve().parent
HEAVY = ("ray", "tensorboard", "asv", "matplotlib")


def test_import_attnbench_imports_no_optional_heavyweights():
    code = (f"import sys, json, attnbench; attnbench.list_implementations(); attnbench.get('sdpa').unavailable_reason(); "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_at_most_ten_modules_at_the_top_and_commands_in_cli():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top
    assert "resolve.py" in top
    assert {"app.py", "run.py", "check.py", "profile.py", "report.py"} <= {p.name for p in (PACKAGE / "cli").glob("*.py")}
