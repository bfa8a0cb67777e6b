"""Which package broke what: the newest versions against the lock, and the failing tests each one's files appear in.

``tools/newest`` runs the fast set in a venv with the newest version of every dependency and calls this with the
lock (``.ci/constraints.txt``), that venv's ``pip freeze`` and pytest's JUnit XML. It prints one line: green, or
each package whose version moved, with the failing tests whose tracebacks pass through that package's files
(``site-packages/<package>/``), so ``transformers 5.24.0 -> 5.25.0: 31 failing tests (tests/test_hf.py,
tests/test_reach.py)``. A failure whose traceback names no moved package is listed apart: the cause is the
project's own code or a package that did not move.
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

_PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)")
_SITE = re.compile(r"site-packages/([A-Za-z0-9_]+)")


def pins(text: str) -> dict[str, str]:
    """``name==version`` lines -> {normalised name: version} (local labels such as ``+cpu`` dropped)."""
    out = {}
    for line in text.splitlines():
        match = _PIN.match(line.strip())
        if match:
            out[normalise(match.group(1))] = match.group(2).split("+")[0]
    return out


def normalise(name: str) -> str:
    """A distribution or import name in one spelling: lower case, ``-`` and ``.`` as ``_``."""
    return re.sub(r"[-.]+", "_", name).lower()


def moved(lock: dict[str, str], newest: dict[str, str]) -> dict[str, str]:
    """{package: "old -> new"} for each package whose newest version differs from the lock (or is new)."""
    return {name: f"{lock.get(name, 'unlocked')} -> {version}" for name, version in sorted(newest.items())
            if lock.get(name) != version}


def failures(junit_xml: str) -> list[tuple[str, str]]:
    """(test id, traceback text) of each failed or erred test case in pytest's JUnit XML."""
    out = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            out.append((test, (bad.get("message") or "") + "\n" + (bad.text or "")))
    return out


def blame(moved_pkgs: dict[str, str], failed: list[tuple[str, str]]) -> tuple[dict[str, list[str]], list[str]]:
    """{moved package: failing tests whose traceback passes through its files}, and the failing tests none explains."""
    by_pkg: dict[str, list[str]] = defaultdict(list)
    unexplained = []
    for test, text in failed:
        hit = {normalise(m) for m in _SITE.findall(text)} & set(moved_pkgs)
        for pkg in hit:
            by_pkg[pkg].append(test)
        if not hit:
            unexplained.append(test)
    return dict(by_pkg), unexplained


def _files(tests: list[str]) -> str:
    return ", ".join(sorted({t.split("::")[0] for t in tests}))


def summary(moved_pkgs: dict[str, str], failed: list[tuple[str, str]], status: int) -> str:
    """The one line ``tools/newest`` ends with."""
    n_moved = f"{len(moved_pkgs)} package(s) newer than the lock"
    if status == 0 and not failed:
        return f"newest: green ({n_moved}; refresh the lock with tools/lock)"
    by_pkg, unexplained = blame(moved_pkgs, failed)
    parts = [f"{pkg} {moved_pkgs[pkg]}: {len(tests)} failing test(s) ({_files(tests)})" for pkg, tests in by_pkg.items()]
    if unexplained:
        parts.append(f"{len(unexplained)} failing test(s) through no moved package's files ({_files(unexplained)})")
    if not parts:
        parts.append(f"pytest exited {status} with no failing test recorded")
    return f"newest: RED ({n_moved}): " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lock", required=True)
    parser.add_argument("--freeze", required=True)
    parser.add_argument("--junit", required=True)
    parser.add_argument("--status", type=int, default=0)
    args = parser.parse_args(argv)
    lock, newest = pins(Path(args.lock).read_text()), pins(Path(args.freeze).read_text())
    failed = failures(args.junit) if Path(args.junit).is_file() else []
    print(summary(moved(lock, newest), failed, args.status))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
