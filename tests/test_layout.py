"""The package's shape: a few core modules at the top, and a light ``import attnbench``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import attnbench
from tests.test_imports import cycles, import_graph

PACKAGE = Path(attnbench.__file__).resolve().parent
HEAVY = ("ray", "tensorboard", "asv", "matplotlib")


def test_import_attnbench_imports_no_optional_heavyweights():
    code = (f"import sys, json, attnbench; attnbench.list_implementations(); attnbench.get('sdpa').unavailable_reason(); "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_at_most_eleven_modules_at_the_top_and_commands_in_cli():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 11, top  # locks.py: the lock-file primitive both the run and the machine lock use
    assert "resolve.py" in top
    assert {"app.py", "run.py", "check.py", "profile.py", "report.py"} <= {p.name for p in (PACKAGE / "cli").glob("*.py")}


# ---------------------------------------------------------------- import cycles, counted the strict way

ROOT = PACKAGE.parent


def test_the_cycle_count_sees_imports_inside_functions_and_by_name(tmp_path):
    pkg = tmp_path / "attnbench"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from attnbench import b\n")
    (pkg / "b.py").write_text("import importlib\nimportlib.import_module('attnbench.a')\n")
    (pkg / "sub" / "__init__.py").write_text("from attnbench.sub.page import x\n")
    (pkg / "sub" / "page.py").write_text("from attnbench.c import y\n")
    (pkg / "c.py").write_text("def g():\n    from attnbench.sub import fig\n")  # runs sub/__init__ -> page -> c
    (pkg / "sub" / "fig.py").write_text("")
    (pkg / "d.py").write_text("from attnbench.a import f\n")  # an arrow, no cycle
    assert sorted(cycles(import_graph(tmp_path, strict=True))) == [
        ["attnbench.a", "attnbench.b"], ["attnbench.c", "attnbench.sub", "attnbench.sub.page"]]


KNOWN_CYCLES: dict[str, str] = {}
"""A module of each cycle still there -> why (empty is the goal; the test fails when this list is out of date)."""


def test_no_import_cycle_strict():
    found = cycles(import_graph(strict=True))
    unexplained = [c for c in found if not set(c) & set(KNOWN_CYCLES)]
    assert not unexplained, "import cycles (strict count; see import_graph):\n" + "\n".join(" <-> ".join(c) for c in unexplained)
    fixed = [m for m in KNOWN_CYCLES if not any(m in c for c in found)]
    assert not fixed, f"no longer in a cycle (drop them from KNOWN_CYCLES): {fixed}"
    assert len(found) == len(KNOWN_CYCLES), found


# ---------------------------------------------------------------- function length

MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS: dict[str, str] = {}  # issue 45: the last five were split
"""``path:function`` -> why it stays longer than :data:`MAX_FUNCTION_LINES` (keep this list short)."""


def _long_functions(root: Path) -> dict[str, int]:
    out = {}
    for base in (root / "attnbench", root / "implementations"):
        for path in sorted(base.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        out[f"{path.relative_to(root).as_posix()}:{node.name}"] = lines
    return out


def test_no_function_over_60_lines_outside_the_allowed_list():
    long = _long_functions(ROOT)
    unlisted = {k: v for k, v in long.items() if k not in LONG_FUNCTIONS}
    assert not unlisted, f"functions over {MAX_FUNCTION_LINES} lines (split them, or list them with a reason): {unlisted}"
    stale = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not stale, f"listed as long but no longer over {MAX_FUNCTION_LINES} lines (drop them from the list): {stale}"


def test_the_function_length_check_measures_def_to_end(tmp_path):
    (tmp_path / "attnbench").mkdir()
    (tmp_path / "implementations").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "attnbench" / "m.py").write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n")
    assert _long_functions(tmp_path) == {"attnbench/m.py:long": MAX_FUNCTION_LINES + 1}
