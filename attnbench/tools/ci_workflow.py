"""``attnbench ci github``: a GitHub Actions workflow that gates a pull request on correctness and speed.

On each pull request it installs CPU PyTorch and the project, runs ``attnbench check`` on the project's
implementations, times a small sweep of the PR head and of the base branch (``attnbench run``, then
``attnbench compare`` for the compare page), runs the asv gate (``attnbench asv-compare``) between the base
branch and the PR head, and uploads the HTML report, the compare page and the gate's table as artifacts.
The gate has two layers (issue 39): instruction counts (valgrind is installed; ``attnbench run --metric
instructions`` of the head and the base, ``attnbench compare`` at a threshold set by each count's recorded noise or
``--instr-threshold``; the asv gate's ``track_instructions``) fail on a small increase in work, and wall time keeps
its factor and confirmation pass. The compare page's ``attnbench compare`` exits 3 when a slowdown timed under other
load is inconclusive (issue 45): the step times the base and the head once more, compares again, and fails when it is
still inconclusive (a slowdown there warns: the asv gate decides wall time).
attnbench itself is installed from ``--attnbench-source`` (a git URL, a path or a requirement string; default
:func:`default_source`): it is on no package index.
The text is a template with ``@NAME@`` placeholders (YAML's ``${{ }}`` leaves no brace syntax free).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
from pathlib import Path

from attnbench.errors import AttnbenchError

DEFAULT_PATH = Path(".github") / "workflows" / "attnbench.yml"

TEMPLATE = """\
# Written by `attnbench ci github` (attnbench @VERSION@); edit freely, or rewrite it with the same command.
name: attnbench

on:
  pull_request:

permissions:
  contents: read

concurrency:
  group: attnbench-${{ github.event.pull_request.number }}
  cancel-in-progress: true

jobs:
  attnbench:
    runs-on: ubuntu-latest
    timeout-minutes: @TIMEOUT@
    env:
      BASE_REF: ${{ github.base_ref }}
    steps:
      - uses: actions/checkout@v4
        with:
          fetch-depth: 0  # the base branch too: the sweep and the asv gate measure it
      - uses: actions/setup-python@v5
        with:
          python-version: "@PYTHON@"
      - name: Install valgrind (instruction counts)
        run: sudo apt-get update -q && sudo apt-get install -y -q valgrind
      - name: Install CPU PyTorch and the project
        run: |
          python -m pip install --upgrade pip
          python -m pip install @TORCH@ --index-url https://download.pytorch.org/whl/cpu
          python -m pip install -e @PROJECT@ @ATTNBENCH@
      - name: Correctness matrix (attnbench check)
        run: attnbench check @IMPLS@
      - name: Sweep the PR head
        run: attnbench run --preset @PRESET@@IMPL_FLAGS@ --out runs/head --report-dir reports/head
      - name: Sweep the base branch
        run: |
          git worktree add ../attnbench-base "origin/${BASE_REF}"
          cd ../attnbench-base
          python -m pip install --no-deps -e .
          attnbench run --preset @PRESET@@IMPL_FLAGS@ --out "${GITHUB_WORKSPACE}/runs/base" --no-report
          cd "${GITHUB_WORKSPACE}"
          python -m pip install --no-deps -e .
      - name: Count instructions of the PR head and the base branch (layer 1 of the gate)
        run: |
          attnbench run --metric instructions --preset @PRESET@@IMPL_FLAGS@ --out runs/head-count
          cd ../attnbench-base
          python -m pip install --no-deps -e .
          attnbench run --metric instructions --preset @PRESET@@IMPL_FLAGS@ --out "${GITHUB_WORKSPACE}/runs/base-count"
          cd "${GITHUB_WORKSPACE}"
          python -m pip install --no-deps -e .
      - name: Instruction gate (fails on more instructions per call than @INSTR_PCT@)
        run: |
          set -o pipefail
          mkdir -p reports/instructions
          attnbench compare runs/base-count/* runs/head-count/*@INSTR_FLAG@ | tee reports/instructions/compare.txt
      - name: Compare page (base vs head; exit 3, inconclusive under load, times both again once, then fails)
        run: |
          status=0
          attnbench compare runs/base/* runs/head/* --speedups -o reports/compare || status=$?
          if [ "$status" -eq 3 ]; then
            echo "::warning::attnbench compare was inconclusive (other load while timing): timing both again once"
            attnbench run --preset @PRESET@@IMPL_FLAGS@ --out runs/head-again --no-report
            cd ../attnbench-base
            python -m pip install --no-deps -e .
            attnbench run --preset @PRESET@@IMPL_FLAGS@ --out "${GITHUB_WORKSPACE}/runs/base-again" --no-report
            cd "${GITHUB_WORKSPACE}"
            python -m pip install --no-deps -e .
            status=0
            attnbench compare runs/base-again/* runs/head-again/* --speedups -o reports/compare || status=$?
          fi
          case "$status" in
            0) ;;
            1) echo "::warning::attnbench compare found a slowdown (see the compare page; the asv gate decides)" ;;
            3) echo "::error::attnbench compare is still inconclusive after timing both again"; exit 3 ;;
            *) echo "::error::attnbench compare failed (exit $status): nothing compared?"; exit "$status" ;;
          esac
      - name: asv gate (base branch vs PR head; layer 2, wall time with factor and confirmation)
        run: |
          set -o pipefail  # the gate's exit status, not tee's, decides the step
          mkdir -p reports/asv
          attnbench asv-compare "origin/${BASE_REF}" HEAD --factor @FACTOR@ --instr-threshold @ASV_INSTR@ \\
            --keep reports/asv | tee reports/asv/compare.txt
      - name: Upload the report and the compare pages
        if: always()
        uses: actions/upload-artifact@v4
        with:
          name: attnbench-reports
          path: |
            reports/head
            reports/compare
            reports/asv/compare.txt
            reports/instructions/compare.txt
          if-no-files-found: warn
"""


HOME_GIT = "git+https://github.com/attnbench/attnbench"
"""attnbench's home repository (``asv.conf.json``'s ``project_url``): the last default source of the install."""
NEEDED = (("pyproject.toml", "the workflow installs the project with pip install -e ."),
          ("asv.conf.json", "the asv gate needs an asv configuration (attnbench's own is an example)"),
          ("benchmarks", "the asv gate runs the benchmarks folder (track_instructions and time_ benchmarks)"))


def requirement(source: str) -> str:
    """The pip argument that installs attnbench (with its asv extra) from ``source``: a git URL (``git+https://...``,
    ``https://...git``), a path (``./vendor/attnbench``) or a requirement string (``attnbench==0.1.0``), quoted."""
    text = source.strip()
    if not text:
        raise AttnbenchError("--attnbench-source is empty; give a git URL, a path or a requirement string")
    if text.startswith("git+") or text.endswith(".git") or "github.com/" in text:
        url = text if text.startswith("git+") else f"git+{text}"
        return shlex.quote(f"attnbench[asv] @ {url}")
    if text.startswith((".", "/", "~")):
        return shlex.quote(f"{text.rstrip('/')}[asv]")
    return shlex.quote(text)


def default_source(repo: Path) -> tuple[str, str]:
    """Where the workflow installs attnbench from when no source is given, and why: the repository itself when it is
    attnbench; else the git URL and commit this attnbench was installed from (PEP 610); else :data:`HOME_GIT`."""
    pyproject = repo / "pyproject.toml"
    if pyproject.is_file() and re.search(r'(?m)^name\s*=\s*"attnbench"', pyproject.read_text(errors="replace")):
        return ".", "the repository is attnbench itself"
    try:
        direct = json.loads(importlib.metadata.distribution("attnbench").read_text("direct_url.json") or "{}")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        direct = {}
    if direct.get("vcs_info", {}).get("vcs") == "git":
        commit = direct["vcs_info"].get("commit_id", "")
        return f"git+{direct['url']}" + (f"@{commit}" if commit else ""), "where this attnbench was installed from"
    return HOME_GIT, ("attnbench's home repository; pass --attnbench-source (a git URL, a path or a requirement) if "
                      "you install it from elsewhere")


def missing_files(repo: Path) -> list[str]:
    """Warnings for what the workflow needs and ``repo`` lacks."""
    return [f"{repo / name} is missing: {why}" for name, why in NEEDED if not (repo / name).exists()]


def _install(source: str) -> dict[str, str]:
    """The install line's placeholders: the project (editable) and attnbench, or the project alone (with the asv
    extra) when it is attnbench (``source`` ``"."``)."""
    if source.strip() in (".", "./"):
        return {"PROJECT": shlex.quote(".[asv]"), "ATTNBENCH": ""}
    return {"PROJECT": ".", "ATTNBENCH": requirement(source)}


def render(impls: list[str] | None = None, python: str = "3.11", torch: str = "torch", preset: str = "smoke",
           factor: float = 1.2, timeout_minutes: int = 90, attnbench_source: str | None = None,
           instr_threshold: float | None = None, repo: Path | None = None) -> str:
    """The workflow's text. ``impls``: what ``check`` and the sweeps run (default: every implementation available,
    the project's entry-point plug-ins included); ``torch``: the pip requirement (``torch==2.5.1``);
    ``attnbench_source``: where attnbench is installed from (:func:`requirement`; default :func:`default_source` of
    ``repo``, the current directory by default); ``instr_threshold``: the instruction gate's (0.01 = 1%; None: each
    cell's from its counts' recorded repeat spread, and the asv gate's default 1%)."""
    from importlib.metadata import version as _dist_version

    __version__ = _dist_version("attnbench")

    if factor <= 1:
        raise AttnbenchError(f"--factor {factor} must be above 1 (1.2: a 20% slowdown fails the gate)")
    if instr_threshold is not None and not 0 < instr_threshold < 1:
        raise AttnbenchError(f"--instr-threshold {instr_threshold} must be a fraction in (0, 1) (0.01: 1%)")
    source = attnbench_source or default_source(Path(repo or "."))[0]
    impls = list(impls or [])
    quoted = " ".join(shlex.quote(i) for i in impls)
    flags = "".join(f" --impl {shlex.quote(i)}" for i in impls)
    text = TEMPLATE
    for key, value in {"VERSION": __version__, "TIMEOUT": str(timeout_minutes), "PYTHON": python,
                       "TORCH": shlex.quote(torch), "IMPLS": quoted, **_install(source),
                       "IMPL_FLAGS": flags, "PRESET": shlex.quote(preset), "FACTOR": f"{factor:g}",
                       **_instruction_gate(instr_threshold)}.items():
        text = text.replace(f"@{key}@", value)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def _instruction_gate(threshold: float | None) -> dict[str, str]:
    """The instruction gate's placeholders: ``attnbench compare``'s flag and the step's words (none and "its noise"
    when each cell's threshold follows its recorded spread), and the asv gate's threshold (its default, 1%)."""
    if threshold is None:
        return {"INSTR_FLAG": "", "INSTR_PCT": "a threshold set by each count's noise", "ASV_INSTR": "0.01"}
    return {"INSTR_FLAG": f" --instr-threshold {threshold:g}", "INSTR_PCT": f"{100 * threshold:g}%",
            "ASV_INSTR": f"{threshold:g}"}


def write(path: str | Path = DEFAULT_PATH, force: bool = False, **options) -> Path:
    """Write :func:`render`'s workflow to ``path`` (refusing to overwrite a different file unless ``force``)."""
    path = Path(path)
    text = render(**options)
    if path.exists() and not force and path.read_text() != text:
        raise AttnbenchError(f"{path} exists; pass --force to overwrite it (or -o another path)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
