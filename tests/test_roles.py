"""Roles decided by probes (plugins.roles, plugins.stages), the first true cause, and `attnbench adapt`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnbench.plugins.binding import bind
from tests.test_exit_status import cli as run  # attnbench ARGS in this process: (exit status, stdout, stderr)

R = "tests/plugins/roles/conventions.py:"


@pytest.mark.parametrize("cls", ["TwoInts", "Unnamed", "FlagCausal", "Bf16Weights", "OptionalMasks"])
def test_a_real_convention_passes_check_unchanged(repo_cwd, capsys, cls):
    code, out, err = run(["check", "-v", R + cls, "--kind", "forward,backward,causality"], capsys)
    assert code == 0, out + err
    assert re.search(r"PASS \(\d+ passed", out), out


@pytest.mark.parametrize("target", ["kwargs_config_padding_mask.py:KwargsConfigAttention",
                                    "rope_and_length_by_other_names.py:RopeArgAttention",
                                    "width_named_n_state.py:StateWidthAttention",
                                    "string_causal_mask.py:StringMaskAttention"])
def test_reach_conventions_pass(repo_cwd, capsys, target):
    """Classes reproducing minimind (a **kwargs config, a padding mask left None), lit-llama (``rope``,
    ``max_seq_length``), Whisper (``n_state``; a mask whose content is ignored) and lingua (a constructor theta beside
    forward tables, rotation matrices): tests/plugins/reach_roles."""
    code, out, err = run(["check", "tests/plugins/reach_roles/" + target, "--kind", "forward,backward,causality,decode"],
                         capsys)
    assert code == 0 and "PASS" in out, out + err


def test_a_whole_block_is_refused_as_such(repo_cwd, capsys):
    code, _, err = run(["check", R + "WholeBlock"], capsys)
    assert code == 2 and "is a whole block, not an attention layer" in err and "attn (TwoInts)" in err


def test_two_unknown_ints_get_width_and_heads_by_the_projections_shapes(repo_cwd):
    from attnbench.plugins import import_file

    module = import_file("tests/plugins/roles/conventions.py")
    binding = bind(module.Unnamed)
    assert dict(binding.params) == {"a": "d_in", "b": "num_heads"}
    assert "roles decided by a probe" in binding.describe()


def test_verbose_names_the_flag_and_the_cast(repo_cwd, capsys):
    _, out, _ = run(["check", "-v", R + "FlagCausal", "--kind", "causality"], capsys)
    assert "autoregressive: set to True for causal attention" in out
    _, out, _ = run(["check", "-v", R + "Bf16Weights", "--kind", "causality"], capsys)
    assert "built in bfloat16: cast as a whole" in out


def test_construction_is_the_first_cause_not_a_later_symptom(repo_cwd, capsys):
    code, out, err = run(["check", R + "BrokenInit"], capsys)
    assert code == 2
    headline = err.strip().splitlines()[0]
    assert headline.startswith("error: BrokenInit cannot be built"), err
    assert "TypeError" in err and "no_such_argument" in err
    assert "not causal" not in err


def test_an_unsolvable_role_is_named_alone_and_adapt_writes_a_todo_a_user_completes(repo_cwd, capsys, tmp_path):
    code, _, err = run(["check", R + "NeedsLayout"], capsys)
    assert code == 2 and "'layout' (str)" in err and "'width'" not in err and "attnbench adapt" in err
    adapter = tmp_path / "needs_adapter.py"
    code, out, _ = run(["adapt", R + "NeedsLayout", "-o", str(adapter)], capsys)
    assert code == 0 and "1 TODO(s)" in out
    text = adapter.read_text()
    assert "width=spec.d_in" in text and "n_head=spec.num_heads" in text
    code, _, err = run(["check", f"{adapter}:Adapted"], capsys)  # not yet completed: the TODO is the cause
    assert code == 2 and "adapter TODO: layout" in err
    done = tmp_path / "needs_adapter_done.py"  # a new file: this process keeps the first one imported
    done.write_text(re.sub(r"layout=TODO\(.*\),", 'layout="bthd",', text))  # what the user writes
    code, out, err = run(["check", f"{done}:Adapted"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_adapt_refuses_to_overwrite(repo_cwd, capsys, tmp_path):
    existing = tmp_path / "a.py"
    existing.write_text("x = 1\n")
    code, _, err = run(["adapt", R + "TwoInts", "-o", str(existing)], capsys)
    assert code == 2 and "--force" in err
    assert Path(existing).read_text() == "x = 1\n"
