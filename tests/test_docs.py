"""The documentation (README.md and the mkdocs site under docs/) against the code: every ``attnbench`` command shown
names a real command and real options, every ``python -m`` module exists, every Python block parses, and the
README stays a page a newcomer reads in five minutes. The slow set builds the site with ``mkdocs build --strict``."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from attnbench.cli import cli

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[tuple[Path, str]]:
    return [(p, m.group(2)) for p in PAGES for m in FENCE.finditer(p.read_text(encoding="utf-8"))
            if m.group(1) == lang]


def commands(text: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments dropped, ``&&`` / ``;`` chains split."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        out += [part.strip() for part in re.split(r"&&|;|\|", line) if part.strip()]
    return out


def _words(command: str) -> list[str]:
    command = re.sub(r"<[^>]*>", "X", command)  # placeholders: results/<run-id>
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def _option_names(command: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for p in command.params:
        if isinstance(p, click.Option):
            names |= set(p.opts) | set(p.secondary_opts)
    return names


def attnbench_problems(command: str) -> list[str]:
    """What is wrong with one ``attnbench ...`` command line as the CLI stands (empty: nothing)."""
    words = _words(command)[1:]
    group: click.Command = cli
    while isinstance(group, click.Group) and words and not words[0].startswith("-"):
        sub = group.commands.get(words[0])
        if sub is None:
            return [f"no command {words[0]!r}"]
        group, words = sub, words[1:]
    known = _option_names(group) | ({"--version"} if group is cli else set())
    return [f"{group.name}: no option {w.split('=')[0]!r}" for w in words
            if w.startswith("-") and len(w) > 1 and not re.fullmatch(r"-\d.*", w) and w.split("=")[0] not in known]


def shown_commands() -> list[tuple[str, str]]:
    return [(p.relative_to(REPO).as_posix(), c) for p, text in blocks("bash") + blocks("sh") + blocks("")
            for c in commands(text)]


def test_every_attnbench_command_shown_in_the_docs_is_a_real_command_with_real_options():
    checked, problems = 0, []
    for page, command in shown_commands():
        if command.startswith("attnbench "):
            checked += 1
            problems += [f"{page}: `{command}`: {p}" for p in attnbench_problems(command)]
    assert checked >= 30, checked  # the docs show dozens; far fewer means the block parsing broke
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_renamed_flag():
    assert attnbench_problems("attnbench run --impl sdpa --sequence 128") == ["run: no option '--sequence'"]
    assert attnbench_problems("attnbench runn") == ["no command 'runn'"]
    assert attnbench_problems("attnbench run --preset llama3 --budget 0.1 -q") == []


def test_every_python_module_the_docs_run_exists():
    missing = []
    for page, command in shown_commands():
        words = _words(command)
        if words[:2] in (["python", "-m"], ["python3", "-m"]) and words[2].startswith("attnbench"):
            if importlib.util.find_spec(words[2]) is None:
                missing.append(f"{page}: {command}")
    assert not missing, missing


def test_every_python_block_parses():
    bad = []
    for page, text in blocks("python"):
        try:
            ast.parse(text)
        except SyntaxError as exc:
            bad.append(f"{page.relative_to(REPO)}: {exc}")
    assert not bad, bad


def test_the_readme_is_short_and_keeps_the_two_first_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '.[dev]' "
            "&& attnbench run") in text
    assert "python -m pytest -q" in text
    assert "mkdocs serve" in text and "docs/" in text


def test_the_docs_say_how_to_get_a_cpu_build_elsewhere():
    text = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    assert "CUDA" in text


def test_every_page_is_in_the_site_navigation():
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    later = {"correctness.md", "instructions.md", "accuracy.md"}  # added to the nav when their branches merge
    missing = [p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")
               if p.relative_to(REPO / "docs").as_posix() not in nav and p.name not in later]
    assert not missing, missing


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (the dev extra includes it)")
    out = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "--target-ci" in cli_page and "--wide" in cli_page  # generated from the click commands
    api_page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "compare_runs" in api_page and "AttnSpec" in api_page


@pytest.mark.slow
@pytest.mark.parametrize("command", ["attnbench list", "attnbench list --wide", "attnbench run --help",
                                     "attnbench check --help", "attnbench --help"])
def test_short_commands_of_the_docs_run(command):
    exe = Path(sys.executable).parent / "attnbench"
    out = subprocess.run([str(exe), *command.split()[1:]], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
