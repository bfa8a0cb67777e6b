"""`attnbench list` and `attnbench check`: output, exit codes, and one-line errors without tracebacks."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnbench import cli
from attnbench.correctness.matrix import cases
from tests.refusal_text import refusal_text  # a refusal: an error: headline, a few short indented lines

pytestmark = pytest.mark.usefixtures("single_thread")

BUILTINS = {"wrapper", "weight_split", "fused_qkv", "einsum", "per_head_linear", "sdpa", "sdpa_math", "sdpa_flash",
            "sdpa_efficient", "sdpa_cudnn", "sdpa_mask", "torch_mha", "flex"}
NO_CUDA = not torch.cuda.is_available()
no_cuda_only = pytest.mark.skipif(not NO_CUDA, reason="checks the behaviour on a machine without CUDA")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``attnbench ARGV`` in-process: (exit code, stdout, stderr)."""
    try:
        cli.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, pattern: str) -> None:
    assert code == 2, f"exit code {code}, stderr:\n{err}"
    assert "Traceback" not in err, err
    assert re.search(pattern, refusal_text(err)), err  # an error: headline, then at most a few short lines


# --- attnbench list ------------------------------------------------------------------------------

def test_list_table(capsys):
    code, out, _ = run_cli(["list"], capsys)
    assert code == 0
    for name in BUILTINS:
        assert re.search(rf"\b{name}\b", out), f"{name} missing from `attnbench list`"
    if NO_CUDA:
        for name in ("sdpa_efficient", "sdpa_cudnn"):
            line = next(line for line in out.splitlines() if re.search(rf"\b{name}\b", line))
            assert "needs CUDA" in line, line
        weight_split = next(line for line in out.splitlines() if re.search(r"\bweight_split\b", line))
        assert "yes" in weight_split


def test_list_json(capsys):
    code, out, _ = run_cli(["list", "--json"], capsys)
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert BUILTINS <= set(rows)
    for r in rows.values():
        assert {"available", "reason", "description", "source", "devices", "dtypes", "backward", "dropout"} <= set(r)
        assert isinstance(r["available"], bool) and (r["available"] == (r["reason"] == ""))
    assert rows["weight_split"]["available"] is True and rows["weight_split"]["origin"] == "builtin"
    assert rows["flex"]["dropout"] == [] and rows["torch_mha"]["same_width_only"] is True
    if NO_CUDA:
        for name in ("sdpa_efficient", "sdpa_cudnn"):
            assert rows[name]["available"] is False and rows[name]["reason"] == "needs CUDA"


def test_list_mentions_compile_modes(capsys):
    _, out, _ = run_cli(["list"], capsys)
    assert "compiled:NAME[@MODE]" in out


# --- attnbench check -----------------------------------------------------------------------------

def test_check_builtin_passes(capsys):
    code, out, err = run_cli(["check", "--impl", "weight_split"], capsys)
    assert code == 0, out + err
    summary = re.search(r"(\d+) passed, 0 failed, (\d+) skipped", out)
    assert summary, out
    assert int(summary.group(1)) + int(summary.group(2)) == len(cases())
    assert "FAIL" not in out and "ERROR" not in out


def test_check_kind_filter(capsys):
    code, out, _ = run_cli(["check", "--impl", "weight_split", "--kind", "causality,golden"], capsys)
    assert code == 0 and "2 passed, 0 failed, 0 skipped" in out


def test_check_buggy_plugin_exits_1(repo_cwd, capsys):
    code, out, err = run_cli(["check", "--impl", "tests/plugins/buggy.py:NoMask"], capsys)
    assert code == 1, out + err
    assert re.search(r"\d+ passed, [1-9]\d* failed", out)
    fails = [line for line in out.splitlines() if line.strip().startswith("FAIL")]
    assert any("causality" in line and "changed when later tokens changed" in line for line in fails), out


def test_check_plugin_whose_constructor_raises_exits_2_once(repo_cwd, capsys):
    code, out, err = run_cli(["check", "--impl", "tests/plugins/bad.py:RaisesInInit", "--kind", "forward"], capsys)
    assert_one_line_error(code, err, "RaisesInInit.*refuses to be built")
    assert "ERROR" not in out  # reported once, before any case runs


USER_FILE = '''
    import torch
    from torch import nn


    class MyAttention(nn.Module):
        def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
            super().__init__()
            self.num_heads = num_heads
            self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.out_proj = nn.Linear(d_out, d_out)
            self.dropout = dropout

        def forward(self, x):
            b, T, _ = x.shape
            q, k, v = (p(x).view(b, T, self.num_heads, -1).transpose(1, 2)
                       for p in (self.W_query, self.W_key, self.W_value))
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
            return self.out_proj(out.transpose(1, 2).reshape(b, T, -1))
'''


def test_user_checks_their_own_file(tmp_path, monkeypatch, capsys):
    """The README's two lines: write path/to/my_attention.py, then
    ``attnbench check --impl path/to/my_attention.py:MyAttention``."""
    target = tmp_path / "path" / "to" / "my_attention.py"
    target.parent.mkdir(parents=True)
    target.write_text(textwrap.dedent(USER_FILE))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["check", "--impl", "path/to/my_attention.py:MyAttention"], capsys)
    assert code == 0, out + err
    assert re.search(r"\d+ passed, 0 failed", out)

    target.write_text(textwrap.dedent(USER_FILE).replace("is_causal=True", "is_causal=False"))
    other = tmp_path / "path" / "to" / "my_attention_nomask.py"
    target.rename(other)
    code, out, _ = run_cli(["check", "--impl", "path/to/my_attention_nomask.py:MyAttention", "--kind", "causality"],
                           capsys)
    assert code == 1 and "0 passed, 1 failed" in out


# --- user errors: one line, exit 2, no traceback ---------------------------------------------------

USER_ERRORS = {
    "unknown_impl": (["check", "--impl", "weight_splt"],
                     r"unknown implementation 'weight_splt'.*did you mean weight_split"),
    "unknown_in_list": (["check", "--impl", "sdpa,flesh"], r"'flesh'.*did you mean flex"),
    "missing_file": (["check", "--impl", "tests/plugins/no_such_file.py:MyAttention"], r"does not exist"),
    "missing_class": (["check", "--impl", "tests/plugins/good.py:MyAttention"],
                      r"no attribute 'MyAttention'.*PlainAttention"),
    "missing_module": (["check", "--impl", "no_such_module_xyz:MyAttention"],
                       r"module 'no_such_module_xyz' not found"),
    "compile_mode": (["check", "--impl", "compiled:sdpa@fastest"], r"unknown torch.compile mode 'fastest'"),
    "bad_device": (["check", "--device", "banana"], r"unknown device 'banana'"),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_error_is_one_line(repo_cwd, capsys, case):
    argv, pattern = USER_ERRORS[case]
    code, out, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, pattern)
    assert "passed" not in out  # failed before running anything


@no_cuda_only
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_device_without_cuda(capsys, device):
    code, _, err = run_cli(["check", "--impl", "weight_split", "--device", device], capsys)
    assert_one_line_error(code, err, rf"device '{device}' requested but CUDA is not available")


@no_cuda_only
def test_check_unavailable_implementation(capsys):
    code, _, err = run_cli(["check", "--impl", "sdpa_efficient"], capsys)
    assert_one_line_error(code, err, r"sdpa_efficient.*needs CUDA")


def test_check_unknown_kind(capsys):
    code, _, err = run_cli(["check", "--impl", "weight_split", "--kind", "forwrd"], capsys)
    assert_one_line_error(code, err, r"forwrd")


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_console_script_prints_one_line_without_traceback(tmp_path):
    script = shutil.which("attnbench", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-c", "import sys; from attnbench.cli import main; sys.exit(main())"]
    proc = subprocess.run(cmd + ["check", "--impl", "weight_splt"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert_one_line_error(proc.returncode, proc.stderr, r"did you mean weight_split")
    assert proc.stdout == ""
