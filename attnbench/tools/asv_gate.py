"""The asv regression gate: benchmark two commits in the existing environment and fail on a slowdown.

``asv continuous`` would build a fresh environment per commit (PyTorch per commit: far too heavy), so
with ``environment_type: existing`` the gate does it by hand:

1. each commit is exported (``git archive``) and installed with ``pip install --no-deps --target``
   into its own temporary folder, which asv puts first on its benchmark processes' ``sys.path``
   (``ASV_PYTHONPATH``; asv >= 0.6.5 applies it to discovery too, and drops plain ``PYTHONPATH``). The
   environment's own install (usually the user's editable checkout) is never modified, so nothing has
   to be restored, even after a crash or Ctrl-C, and other processes using the same environment are
   undisturbed;
2. ``asv run --python=PYTHON --set-commit-hash SHA --record-samples`` records each commit's results.
   Commits are alternated (BASE, HEAD, BASE, HEAD with ``--append-samples``) so that a change in the
   machine's load during the gate hits both sides alike;
3. ``asv compare --factor F --split`` prints the table. asv's compare always exits 0, so its table is
   parsed: a *timed* benchmark (``time_*``, raw samples recorded) is a regression when asv marks it
   worse (``+``: slower by more than the factor *and* statistically significant on its samples) and
   any benchmark is one when newly failing (``!``). ``track_*`` figures carry one number per run and
   no samples, so no test can tell a change from noise (GFLOP/s is time in disguise): the gate
   reports their changes (``track_gflops`` is higher-is-better, so its ``-`` is the worse one) but
   does not fail on them;
4. a timed benchmark found slower is measured again, on its own, in ``--confirm`` fresh alternating
   rounds (new results): it fails the gate only if that comparison finds it slower too. A burst of load
   from another process during the long first pass hits one side and does not repeat; a real slowdown
   does. (asv's ``--bench`` regex matches ``name(param, ...)``, so exactly the flagged combinations rerun.)
5. instruction counts (``track_instructions``, issue 39: :mod:`attnbench.measure.instructions`) are the gate's
   second layer: they repeat to a few parts per million whatever the load, so a count more than
   ``--instr-threshold`` (default 1%) higher at HEAD fails the gate on ``asv compare --factor 1+threshold``'s
   ratio alone, with no confirmation pass; at the timed ``--factor`` they are neither reported nor failing.

Every asv process measures under ``attnbench run``'s controlled CPU environment
(:func:`attnbench.measure.cpu_env.process_env` with the ``pinned`` allocator and OpenMP binding),
set in the environment the gate starts asv with; the suite sets the OpenMP part itself otherwise.

The benchmark suite itself (``benchmarks/``) is always the current checkout's, so both commits are
measured by the same code and asv keeps their results comparable. asv runs with ``HOME`` set to the
gate's temporary folder (its machine file lives there), results go to that folder too and are deleted
at the end unless ``--keep`` is given.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from attnbench.errors import AttnbenchError
from attnbench.measure import cpu_env, machine_lock

MACHINE = "attnbench-gate"
HIGHER_IS_BETTER = re.compile(r"\.track_(gflops|gbytes_per_s|frac_peak_bw)\b")
"""Benchmarks where a larger value is better; asv's compare assumes smaller is better for all."""
TIMED = re.compile(r"\.time_\w+")
"""Benchmarks timed by asv with raw samples: the only ones whose slowdown fails the gate."""
EXIT_OK, EXIT_REGRESSION, EXIT_ERROR = 0, 1, 2
COUNTED = re.compile(r"\.track_instructions\b")
"""Instruction counts (issue 39): exact, so they fail the gate past ``--instr-threshold`` without a confirmation pass."""
INSTR_THRESHOLD = 0.01


def _log(message: str) -> None:
    print(message, flush=True)  # flushed: asv's own output goes straight to the same stream


class GateError(AttnbenchError):
    """The gate could not run (bad revision, no asv, an install or asv run failed)."""


@dataclass
class GateResult:
    """What the gate found: the compare table and the rows that count as regressions."""

    base: str
    head: str
    table: str
    regressions: list[str] = field(default_factory=list)
    reported: list[str] = field(default_factory=list)  # worse track_* figures: shown, not failing
    failed_runs: list[str] = field(default_factory=list)  # "sha: asv run exit 2" (some benchmarks failed)
    unconfirmed: list[str] = field(default_factory=list)  # slower in the first pass only: not regressions

    @property
    def exit_code(self) -> int:
        return EXIT_REGRESSION if self.regressions else EXIT_OK


def _run(cmd: list[str], cwd: Path | str | None = None, env: dict | None = None, capture: bool = False,
         check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.STDOUT if capture else None)
    if check and proc.returncode != 0:
        out = f"\n{proc.stdout[-3000:]}" if capture and proc.stdout else ""
        raise GateError(f"`{' '.join(map(str, cmd))}` failed with exit status {proc.returncode}{out}")
    return proc


def _git(repo: Path, *args: str) -> str:
    try:
        return _run(["git", *args], cwd=repo, capture=True).stdout.strip()
    except GateError as exc:
        raise GateError(f"git {' '.join(args)} in {repo}: {exc}") from None


def resolve_commit(repo: Path, rev: str) -> str:
    """The full commit hash of ``rev`` (a branch, tag, ``HEAD~1``, short hash ...)."""
    try:
        return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except GateError:
        raise GateError(f"{rev!r} is not a commit in {repo}") from None


def export_commit(repo: Path, sha: str, dest: Path) -> Path:
    """The tree of commit ``sha`` extracted to ``dest`` (``git archive``: no worktree, no repo changes)."""
    data = subprocess.run(["git", "archive", "--format=tar", sha], cwd=repo, capture_output=True, check=True).stdout
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        try:
            tar.extractall(dest, filter="data")
        except TypeError:  # Python < 3.11.4: no extraction filters (the archive is our own commit)
            tar.extractall(dest)
    return dest


def install_commit(python: str, source: Path, target: Path) -> Path:
    """``pip install --no-deps --target`` the project at ``source``: a private site folder for ASV_PYTHONPATH."""
    cmd = [python, "-m", "pip", "install", "--no-deps", "--no-compile", "--quiet", "--disable-pip-version-check",
           "--target", str(target), str(source)]
    # the environment's own build backend first (no network); pip's isolated build env if that fails
    proc = _run([*cmd[:4], "--no-build-isolation", *cmd[4:]], capture=True, check=False)
    if proc.returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        retry = _run(cmd, capture=True, check=False)
        if retry.returncode != 0:
            raise GateError(f"pip could not install commit {source.name} into {target} (exit {retry.returncode}); "
                            f"with --no-build-isolation:\n{proc.stdout[-2000:]}\nisolated:\n{retry.stdout[-2000:]}")
    return target


def gate_config(repo: Path, work: Path, config: Path | None = None) -> Path:
    """A copy of the repository's ``asv.conf.json`` with absolute paths and results under ``work``."""
    from asv.util import load_json

    src = config or repo / "asv.conf.json"
    if not src.is_file():
        raise GateError(f"no asv configuration at {src}")
    conf = load_json(str(src), js_comments=True)
    conf.update(repo=str(repo), benchmark_dir=str((src.parent / conf.get("benchmark_dir", "benchmarks")).resolve()),
                results_dir=str(work / "results"), html_dir=str(work / "html"), env_dir=str(work / "env"))
    path = work / "asv.conf.json"
    path.write_text(json.dumps(conf, indent=2))
    return path


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []


def parse_compare(table: str) -> list[str]:
    """The rows of ``asv compare``'s table that are regressions (see the module docstring)."""
    return _worse_rows(table)[0]


def _worse_rows(table: str) -> tuple[list[str], list[str]]:
    """``(regressions, reported)``: worse timed or failing benchmarks; worse ``track_*`` figures."""
    bad, reported = [], []
    for line in table.splitlines():
        cells = _cells(line)
        if len(cells) < 5 or cells[0] == "Change" or all(c and set(c) <= set("-:") for c in cells):
            continue  # not a row, the header, or the |---| rule
        mark, name = cells[0], cells[-1]
        worse = "-" if HIGHER_IS_BETTER.search(name) else "+"
        if mark == "!" or (mark == worse and TIMED.search(name)):
            bad.append(line.strip())
        elif mark == worse:
            reported.append(line.strip())
    return bad, reported


def counted_regressions(table: str) -> list[str]:
    """The ``track_instructions`` rows that ``asv compare --factor 1+instr_threshold`` marks worse (``+``) or newly
    failing (``!``): an instruction count has no noise to test against, so its ratio alone decides."""
    rows = []
    for line in table.splitlines():
        cells = _cells(line)
        if len(cells) >= 5 and cells[0] in ("+", "!") and COUNTED.search(cells[-1]):
            rows.append(line.strip())
    return rows


def _uncounted(*row_lists: list[str]) -> tuple[list[str], ...]:
    """The lists without ``track_instructions`` rows (judged by :func:`counted_regressions` at their own threshold)."""
    return tuple([line for line in rows if not COUNTED.search(_cells(line)[-1])] for rows in row_lists)


def _counted_layer(asv: list[str], shas: dict, env: dict, instr_threshold: float) -> list[str]:
    """:func:`counted_regressions` of ``asv compare`` at the factor ``1 + instr_threshold``."""
    cmd = [*asv, "compare", shas["base"], shas["head"], "--factor", str(1 + instr_threshold), "--split",
           "--machine", MACHINE]
    return counted_regressions(_run(cmd, env=env, capture=True).stdout)


def confirm_regressions(regressions: list[str], again: str) -> tuple[list[str], list[str]]:
    """``(regressions, unconfirmed)``: of the first pass's regression rows, the timed ones that the
    confirmation table ``again`` does not find worse are unconfirmed; newly failing ones (``!``) stay."""
    confirmed = {_cells(line)[-1] for line in _worse_rows(again)[0]}
    unconfirmed = [line for line in regressions if _cells(line)[0] != "!" and _cells(line)[-1] not in confirmed]
    return [line for line in regressions if line not in unconfirmed], unconfirmed


def check_asv(python: str) -> None:
    """asv >= 0.6.5 must be importable by ``python`` (it applies ASV_PYTHONPATH to discovery as well)."""
    proc = _run([python, "-c", "import importlib.metadata as m; print(m.version('asv'))"], capture=True, check=False)
    version = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else ""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    if not version or parts < (0, 6, 5):
        raise GateError(f"the gate needs asv >= 0.6.5 in {python} (found {version or 'none'}); "
                        "pip install 'attnbench[asv]' or 'asv>=0.6.5'")


def run_gate(base: str, head: str, *, repo: str | Path = ".", factor: float = 1.2, bench: list[str] | None = None,
             rounds: int = 2, confirm: int = 2, python: str | None = None, config: str | Path | None = None,
             keep: str | Path | None = None, show_stderr: bool = False, log=_log, instr_threshold=INSTR_THRESHOLD) -> GateResult:
    """Benchmark ``base`` and ``head`` and compare them (module docstring; instruction counts: :func:`_counted_layer`)."""
    python = python or sys.executable
    if rounds < 1:
        raise GateError("--rounds must be at least 1")
    if confirm < 0:
        raise GateError("--confirm must be 0 (no confirmation) or more rounds")
    check_asv(python)
    repo = Path(_git(Path(repo).resolve(), "rev-parse", "--show-toplevel"))
    shas = {"base": resolve_commit(repo, base), "head": resolve_commit(repo, head)}
    work = Path(tempfile.mkdtemp(prefix="attnbench-gate-"))
    try:
        conf = gate_config(repo, work, Path(config).resolve() if config else None)
        env = dict(cpu_env.process_env(cpu_env.CpuEnv("pinned")), HOME=str(work / "home"))
        env[machine_lock.ENV_DIR] = str(machine_lock.lock_dir())  # the user's lock folder, though HOME moves
        (work / "home").mkdir()
        asv = [python, "-m", "asv", "--config", str(conf)]
        _run([*asv, "machine", "--yes", "--machine", MACHINE], env=env, capture=True)
        sites = {}
        for sha in dict.fromkeys(shas.values()):
            log(f"gate: installing {sha[:8]} into a private folder (pip --target)")
            sites[sha] = install_commit(python, export_commit(repo, sha, work / f"src-{sha[:12]}"),
                                        work / f"site-{sha[:12]}")
        failed: list[str] = []
        # one measurement at a time on this machine: the gate times under the lock, its benchmarks under the gate's
        held = machine_lock.acquire([os.environ.get("ATTNBENCH_ASV_DEVICE", "cpu")], purpose="asv regression gate")
        env.update(held.child_env())
        try:
            table = _measure(asv, python, shas, sites, env, rounds, bench, show_stderr, factor, failed, log)
        finally:
            held.release()
        counted = _counted_layer(asv, shas, env, instr_threshold)  # issue 39: instruction counts
        regressions, reported = _uncounted(*_worse_rows(table))
        timed = [line for line in regressions if _cells(line)[0] != "!"]
        if timed and confirm:
            # a timed slowdown counts only if it shows again when measured afresh (new results, alternating):
            # a burst of load from another process during the first pass does not repeat in the second
            names = [_cells(line)[-1] for line in timed]
            log(f"gate: {len(names)} timed benchmark(s) look slower; confirming with {confirm} fresh round(s) each")
            (work / "confirm").mkdir()
            conf2 = gate_config(repo, work / "confirm", Path(config).resolve() if config else None)
            asv2 = [python, "-m", "asv", "--config", str(conf2)]
            held = machine_lock.acquire([os.environ.get("ATTNBENCH_ASV_DEVICE", "cpu")], purpose="asv regression gate")
            env.update(held.child_env())
            try:
                again = _measure(asv2, python, shas, sites, env, confirm, [f"^{re.escape(n)}$" for n in names],
                                 show_stderr, factor, failed, log, label="confirm")
            finally:
                held.release()
            regressions, unconfirmed = confirm_regressions(regressions, again)
            table += "\n\nConfirmation (the slower timed benchmarks measured again):\n" + again
            return GateResult(shas["base"], shas["head"], table, regressions + counted, reported, failed, unconfirmed)
        return GateResult(shas["base"], shas["head"], table, regressions + counted, reported, failed)
    finally:
        if keep and (work / "results").is_dir():
            shutil.copytree(work / "results", Path(keep) / "results", dirs_exist_ok=True)
            log(f"gate: asv results kept in {Path(keep) / 'results'}")
        shutil.rmtree(work, ignore_errors=True)


def _measure(asv: list[str], python: str, shas: dict, sites: dict, env: dict, rounds: int, bench, show_stderr: bool,
             factor: float, failed: list[str], log, label: str = "round") -> str:
    """``rounds`` alternating asv runs of BASE and HEAD (samples appended), then ``asv compare``'s table."""
    for r in range(rounds):
        for side in ("base", "head"):
            sha = shas[side]
            log(f"gate: {label} {r + 1}/{rounds}: asv run at {side} {sha[:8]}")
            # asv strips PYTHONPATH from its benchmark processes; ASV_PYTHONPATH goes first on their sys.path
            run_env = dict(env, ASV_PYTHONPATH=os.pathsep.join([str(sites[sha])] + (
                [os.environ["ASV_PYTHONPATH"]] if os.environ.get("ASV_PYTHONPATH") else [])))
            cmd = [*asv, "run", f"--python={python}", "--set-commit-hash", sha, "--machine", MACHINE,
                   "--record-samples", "-a", "rounds=1"]
            if r or (side == "head" and shas["head"] == shas["base"]):
                cmd.append("--append-samples")
            if show_stderr:
                cmd.append("--show-stderr")
            for regex in bench or ():
                cmd += ["--bench", regex]
            proc = _run(cmd, env=run_env, check=False)
            if proc.returncode == 2:  # asv: some benchmarks failed; compare shows which ('!' at head)
                failed.append(f"{sha[:8]}: some benchmarks failed in {label} {r + 1}")
            elif proc.returncode != 0:
                raise GateError(f"asv run at {sha[:8]} failed with exit status {proc.returncode} (the benchmark "
                                "suite must import with that commit's attnbench)")
    return _run([*asv, "compare", shas["base"], shas["head"], "--factor", str(factor),
                 "--split", "--machine", MACHINE], env=env, capture=True).stdout


def _drop_unmeasured(table: str) -> str:
    """asv's output without rows that are n/a on both sides (parameter sets outside ``--bench``) and
    without the sections that leaves empty."""
    blocks, current = [], []
    for line in table.splitlines():
        cells = _cells(line)
        if len(cells) >= 5 and cells[1] == cells[2] == "n/a":
            continue
        if not line.strip():
            blocks.append(current)
            current = []
        else:
            current.append(line)
    blocks.append(current)
    out: list[list[str]] = []
    for block in blocks:
        if block and _cells(block[0]) and len(block) <= 2:  # a table with a header and a rule only
            if out and len(out[-1]) == 1 and not _cells(out[-1][0]):
                out.pop()  # its section title
            continue
        if block:
            out.append(block)
    return "\n\n".join("\n".join(b) for b in out)


def report(result: GateResult, factor: float, log=_log) -> int:
    """Print the compare table and the verdict; return the exit code."""
    log(_drop_unmeasured(result.table).rstrip())
    for line in result.failed_runs:
        log(f"gate: warning: {line}")
    if result.unconfirmed:
        log(f"\ngate: {len(result.unconfirmed)} timed benchmark(s) were slower in the first pass but not when measured "
            "again (transient load, not the code; they do not fail the gate):")
        for line in result.unconfirmed:
            log(f"  {line}")
    if result.reported:
        log(f"\ngate: {len(result.reported)} track_* figure(s) changed for the worse beyond x{factor:g} (reported; "
            "no samples, so they do not fail the gate):")
        for line in result.reported:
            log(f"  {line}")
    if result.regressions:
        log(f"\ngate: FAIL: {len(result.regressions)} benchmark(s) regressed beyond x{factor:g} "
            f"({result.base[:8]} -> {result.head[:8]}):")
        for line in result.regressions:
            log(f"  {line}")
    else:
        log(f"\ngate: OK: no significant regression beyond x{factor:g} ({result.base[:8]} -> {result.head[:8]})")
    return result.exit_code


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/gate.py", description=(
        "Benchmark BASE and HEAD with asv in this environment (without modifying its install) and exit 1 "
        "when HEAD is significantly slower than BASE by more than --factor; 2 when the gate cannot run."))
    p.add_argument("base", help="the reference commit (branch, tag, hash)")
    p.add_argument("head", help="the commit under test")
    p.add_argument("--factor", type=float, default=1.2, help="ratio beyond which a change counts (default 1.2)")
    p.add_argument("--bench", "-b", action="append", help="asv benchmark regex (repeatable; default: all)")
    p.add_argument("--rounds", type=int, default=2, help="alternating BASE/HEAD asv runs per commit (default 2)")
    p.add_argument("--confirm", type=int, default=2, help="fresh alternating rounds that must show a timed slowdown "
                   "again before it fails the gate (default 2; 0: no confirmation)")
    p.add_argument("--instr-threshold", type=float, default=INSTR_THRESHOLD, help="track_instructions figures more "
                   "than this fraction higher at HEAD fail the gate (default 0.01: 1%%; no confirmation pass)")
    p.add_argument("--python", help="the environment's interpreter (default: this one)")
    p.add_argument("--repo", default=".", help="the git repository (default: the current directory)")
    p.add_argument("--config", help="asv config (default: REPO/asv.conf.json)")
    p.add_argument("--keep", metavar="DIR", help="copy asv's results to DIR/results")
    p.add_argument("--show-stderr", action="store_true", help="pass --show-stderr to asv run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        result = run_gate(args.base, args.head, repo=args.repo, factor=args.factor, bench=args.bench,
                          rounds=args.rounds, confirm=args.confirm, python=args.python, config=args.config, keep=args.keep,
                          show_stderr=args.show_stderr, instr_threshold=args.instr_threshold)
    except GateError as exc:
        print(f"gate: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return report(result, args.factor)


if __name__ == "__main__":
    sys.exit(main())
