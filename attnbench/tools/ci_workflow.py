"""``attnbench ci github``: a GitHub Actions workflow that gates a pull request on correctness and speed.

On each pull request it installs CPU PyTorch and the project, runs ``attnbench check`` on the project's
implementations, times a small sweep of the PR head and of the base branch (``attnbench run``, then
``attnbench compare`` for the compare page), runs the asv gate (``attnbench asv-compare``) between the base
branch and the PR head, and uploads the HTML report, the compare page and the gate's table as artifacts.
The text is a template with ``@NAME@`` placeholders (YAML's ``${{ }}`` leaves no brace syntax free).
"""

from __future__ import annotations

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
      - name: Install CPU PyTorch and the project
        run: |
          python -m pip install --upgrade pip
          python -m pip install @TORCH@ --index-url https://download.pytorch.org/whl/cpu
          python -m pip install -e . "@ATTNBENCH@"
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
      - name: Compare page (base vs head)
        run: |
          if ! attnbench compare runs/base/* runs/head/* --speedups -o reports/compare; then
            echo "::warning::attnbench compare found a slowdown (see the compare page)"
          fi
      - name: asv gate (base branch vs PR head)
        run: |
          set -o pipefail  # the gate's exit status, not tee's, decides the step
          mkdir -p reports/asv
          attnbench asv-compare "origin/${BASE_REF}" HEAD --factor @FACTOR@ --keep reports/asv | tee reports/asv/compare.txt
      - name: Upload the report and the compare pages
        if: always()
        uses: actions/upload-artifact@v4
        with:
          name: attnbench-reports
          path: |
            reports/head
            reports/compare
            reports/asv/compare.txt
          if-no-files-found: warn
"""


def render(impls: list[str] | None = None, python: str = "3.11", torch: str = "torch", preset: str = "smoke",
           factor: float = 1.2, timeout_minutes: int = 60, attnbench_requirement: str = "attnbench[asv]") -> str:
    """The workflow's text. ``impls``: what ``check`` and the sweeps run (default: every implementation available,
    the project's entry-point plug-ins included); ``torch``: the pip requirement (``torch==2.5.1``)."""
    from importlib.metadata import version as _dist_version

    __version__ = _dist_version("attnbench")

    if factor <= 1:
        raise AttnbenchError(f"--factor {factor} must be above 1 (1.2: a 20% slowdown fails the gate)")
    impls = list(impls or [])
    quoted = " ".join(shlex.quote(i) for i in impls)
    flags = "".join(f" --impl {shlex.quote(i)}" for i in impls)
    text = TEMPLATE
    for key, value in {"VERSION": __version__, "TIMEOUT": str(timeout_minutes), "PYTHON": python,
                       "TORCH": shlex.quote(torch), "ATTNBENCH": attnbench_requirement, "IMPLS": quoted,
                       "IMPL_FLAGS": flags, "PRESET": shlex.quote(preset), "FACTOR": f"{factor:g}"}.items():
        text = text.replace(f"@{key}@", value)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def write(path: str | Path = DEFAULT_PATH, force: bool = False, **options) -> Path:
    """Write :func:`render`'s workflow to ``path`` (refusing to overwrite a different file unless ``force``)."""
    path = Path(path)
    text = render(**options)
    if path.exists() and not force and path.read_text() != text:
        raise AttnbenchError(f"{path} exists; pass --force to overwrite it (or -o another path)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
