"""The first true cause at import (issue 46, item 4) and a refusal that stays readable (issue 45, item 5).

Fixtures in ``tests/plugins/refusals/``: a package module that imports a missing dependency (by file and by
``module:Class``), a script asserting CUDA at import, a bare assert over two lines, a failure inside torch called
from a helper module, and a constructor attnbench cannot call.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch

from attnbench import registry
from attnbench.errors import LINE_WIDTH, MAX_LINES, PluginLoadError, refusal_lines
from tests.refusal_text import refusal_lines_of, refusal_text  # noqa: F401  (the shape every refusal has)
from tests.test_exit_status import cli  # attnbench ARGV in this process: (exit status, stdout, stderr)

REPO = Path(__file__).resolve().parent.parent
R = "tests/plugins/refusals/"


def refusal(capsys, target: str) -> list[str]:
    """``attnbench check TARGET``'s stderr lines, asserted to be a readable refusal with exit status 2."""
    code, out, err = cli(["check", R + target], capsys)
    assert code == 2 and "Traceback" not in out, (code, out, err)
    return refusal_lines_of(err)


# --- import: the first true cause --------------------------------------------------------------------

def test_a_package_module_whose_dependency_is_missing_names_the_dependency(repo_cwd, capsys):
    lines = refusal(capsys, "refusalpkg/attn.py:Attention")
    assert "it imports 'attnbench_refusals_absent_kernels', which is not installed here" in lines[0]
    assert "not found" not in "\n".join(lines)
    assert "  at tests/plugins/refusals/refusalpkg/kernels.py:3: import attnbench_refusals_absent_kernels" in lines
    assert "  fix: pip install attnbench_refusals_absent_kernels, or install the project it comes from" in lines


@pytest.fixture
def refusals_on_path(monkeypatch, repo_cwd):
    monkeypatch.syspath_prepend(str(repo_cwd / R))
    yield
    for name in [n for n in sys.modules if n == "refusalpkg" or n.startswith("refusalpkg.")]:
        del sys.modules[name]


def test_the_module_form_tells_a_missing_dependency_from_a_missing_module(refusals_on_path):
    with pytest.raises(PluginLoadError) as info:
        registry.get("refusalpkg.attn:Attention")
    assert str(info.value).startswith("importing 'refusalpkg.attn' failed: it imports "
                                      "'attnbench_refusals_absent_kernels', which is not installed here")
    with pytest.raises(PluginLoadError, match=r"module 'refusalpkg.nothing' not found \(No module named "
                                              r"'refusalpkg.nothing'\)"):
        registry.get("refusalpkg.nothing:Attention")
    with pytest.raises(PluginLoadError, match=r"module 'nopkg_attnbench.attn' not found"):
        registry.get("nopkg_attnbench.attn:Attention")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script imports")
def test_an_assert_of_cuda_at_import_names_the_line_and_says_it_needs_cuda(repo_cwd, capsys):
    lines = refusal(capsys, "needs_cuda.py:Attention")
    text = "\n".join(lines)
    assert "it needs CUDA, which this machine does not have" in lines[0]
    assert "AssertionError at needs_cuda.py:6: assert torch.cuda.is_available()" in text
    assert lines[0] != "error: importing plug-in 'tests/plugins/refusals/needs_cuda.py' failed: AssertionError: "


def test_a_bare_assert_is_named_by_its_statement_over_both_lines(repo_cwd, capsys):
    (line,) = refusal(capsys, "bare_assert.py:Attention")
    assert line.endswith("failed: AssertionError at bare_assert.py:6: assert WIDTH % HEADS == 0 and HEADS > 0")


def test_a_failure_inside_torch_is_located_at_the_innermost_line_of_the_user_s_files(repo_cwd, capsys):
    lines = refusal(capsys, "fails_in_helper.py:Attention")
    assert "failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied" in lines[0]
    assert lines[1] == "  at tests/plugins/refusals/refusal_helpers.py:8: return projection(torch.zeros(width + 1))"


def test_a_package_in_the_src_folder_is_imported_from_there_by_the_module_form(tmp_path, monkeypatch):
    """The src layout run from the repository's root (F5-TTS's ``src/f5_tts``), not installed: imported from src/,
    and ``check -v`` says so; a package under no src/ folder is still "not found"."""
    from attnbench.plugins.loading import IMPORTED

    monkeypatch.chdir(tmp_path)
    pkg = tmp_path / "src" / "srclayout_attnbench"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("WIDTH_NAME = 'd_out'\n")
    (pkg / "attn.py").write_text((REPO / "tests" / "plugins" / "good.py").read_text()
                                 + "\nfrom srclayout_attnbench.helpers import WIDTH_NAME  # noqa: E402\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        impl = registry.get("srclayout_attnbench.attn:PlainAttention")
        assert impl.name == "srclayout_attnbench.attn:PlainAttention"
        assert "from " + str(tmp_path / "src") in IMPORTED["srclayout_attnbench.attn"]
    finally:
        for name in [n for n in sys.modules if n.startswith("srclayout_attnbench")]:
            del sys.modules[name]
    with pytest.raises(PluginLoadError, match=r"module 'elsewhere_attnbench.attn' not found"):
        registry.get("elsewhere_attnbench.attn:PlainAttention")


def test_a_package_under_a_folder_without_init_imported_by_its_full_name(tmp_path, monkeypatch):
    """affjljoo3581/GPT2: ``src/gpt2/modeling/__init__.py`` imports ``gpt2.modeling.attention`` while ``src/gpt2`` has no
    ``__init__.py``: the file is imported under that full name, with ``src`` on sys.path."""
    from attnbench.plugins.loading import IMPORTED

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".git").mkdir()
    pkg = tmp_path / "src" / "nsroot_attnbench" / "modeling"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from nsroot_attnbench.modeling.attn import PlainAttention  # noqa: F401\n")
    (pkg / "attn.py").write_text((REPO / "tests" / "plugins" / "good.py").read_text())
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        impl = registry.get("src/nsroot_attnbench/modeling/attn.py:PlainAttention")
        assert impl.factory is not None
        assert "as nsroot_attnbench.modeling.attn" in IMPORTED["nsroot_attnbench.modeling.attn"]
    finally:
        for name in [n for n in sys.modules if n.startswith(("nsroot_attnbench", "modeling"))]:
            del sys.modules[name]


def test_a_syntax_error_names_its_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import torch\n\ndef attention(x:\n    return x\n")
    with pytest.raises(PluginLoadError) as info:
        registry.get("broken.py:Anything")
    assert info.value.headline == "importing plug-in 'broken.py' failed: SyntaxError: '(' was never closed"
    assert info.value.details == ("at broken.py:3: def attention(x:",)


# --- a refusal stays readable -----------------------------------------------------------------------

def test_a_constructor_refusal_is_a_headline_and_a_few_short_lines(repo_cwd, capsys):
    lines = refusal(capsys, "unbuildable.py:Attention")
    assert "'vocab_file'" in lines[0] and "'tokenizer_name'" in lines[0], lines
    assert len(lines) >= 2


ALIASES = ("d_in: d_in/d_model/embed_dim/n_embd/hidden_size/dim/model_dim/emb_dim/width; d_out: d_out/out_features/"
           "output_dim/out_dim; num_heads: num_heads/n_heads/n_head/num_attention_heads/heads/nheads/n_heads_q; "
           "context_length: context_length/block_size/max_seq_len/max_position_embeddings/max_len/seq_len/ctx_len; "
           "dropout: dropout/attn_pdrop/attention_dropout/p/attn_dropout/dropout_p/drop; qkv_bias: qkv_bias/bias/"
           "use_bias/attention_bias/add_bias_kv; head_dim: head_dim/dim_head/head_size/d_head/d_k; num_kv_heads: "
           "num_kv_heads/n_kv_heads/n_kv_head/num_key_value_heads/n_local_heads/n_query_groups/kv_heads/num_kv_groups; "
           "window: window/window_size/sliding_window/attention_window/local_window; rope_theta: rope_theta/theta/"
           "base/rope_base/rotary_base; qk_norm: qk_norm/use_qk_norm/normalize_qk; config: config/cfg/args/params/"
           "model_args/hparams; layer index: layer_idx/block_idx/layer_id/layer_number/layer_index")
LONG = ("cannot call Block(width, n_heads, vocab_file, tokenizer_name, rope_cache, shard_group): attnbench does not know "
        f"what to pass for 'vocab_file', 'tokenizer_name', 'shard_group' (it binds parameters by name: {ALIASES}); "
        "give them defaults, rename, or point --impl at a factory make_attention(spec) (docs/own-attention.md: Bring "
        "your own attention)")


def test_a_1250_character_refusal_prints_as_a_headline_and_at_most_a_few_short_lines():
    assert len(LONG) > 1200
    lines = refusal_lines(PluginLoadError(LONG))
    assert lines[0] == ("error: cannot call Block(…): attnbench does not know what to pass for 'vocab_file', "
                        "'tokenizer_name', 'shard_group'")  # the long argument list went: the headline keeps the cause
    assert len(lines) <= 1 + MAX_LINES and all(len(line) <= LINE_WIDTH for line in lines[1:]), lines
    assert lines[1].startswith("  it binds parameters by name: d_in: d_in/d_model") and lines[-3].endswith(" …")
    assert lines[-2:] == ["  fix: give them defaults, rename, or point --impl at a factory make_attention(spec)",
                          "  see docs/own-attention.md: Bring your own attention"]


def test_a_short_refusal_stays_one_line_and_a_long_cause_keeps_its_headline():
    assert refusal_lines(PluginLoadError("module 'x' not found")) == ["error: module 'x' not found"]
    lines = refusal_lines(PluginLoadError(
        "ModelParallelAttention cannot be built on this machine: it needs a distributed/model-parallel setup that is "
        "not initialised in this process (AssertionError: model parallel group is not initialized); run it where that "
        "is available, or point --impl at a factory that builds it for one process on this device"))
    assert lines == [
        "error: ModelParallelAttention cannot be built on this machine: it needs a distributed/model-parallel setup "
        "that is not initialised in this process",
        "  AssertionError: model parallel group is not initialized",
        "  fix: run it where that is available, or point --impl at a factory that builds it for one process on this "
        "device"]


def test_details_and_fix_print_as_given_and_the_message_stays_one_line():
    exc = PluginLoadError("cannot call Odd(width, foo): no value for 'foo'",
                          details=["tried: Odd(width=d_in, foo=?)", "foo is used as " + "a very long explanation " * 12],
                          fix="give foo a default")
    assert str(exc).startswith("cannot call Odd(width, foo): no value for 'foo'; tried: Odd(width=d_in, foo=?); ")
    assert str(exc).endswith("; give foo a default") and "\n" not in str(exc)
    lines = refusal_lines(exc)
    assert lines[:2] == ["error: cannot call Odd(width, foo): no value for 'foo'", "  tried: Odd(width=d_in, foo=?)"]
    assert lines[-1] == "  fix: give foo a default" and lines[3].startswith("    ")  # a long detail wraps, indented
    assert all(len(line) <= LINE_WIDTH for line in lines[1:])
    back = pickle.loads(pickle.dumps(exc))  # errors cross process boundaries (workers): the parts survive
    assert (back.headline, back.details, back.fix, str(back)) == (exc.headline, exc.details, exc.fix, str(exc))


def test_a_module_of_its_own_repository_off_sys_path_is_named_where_it_is(repo_cwd, capsys):
    """transformer-xl's ``sys.path.append('utils')`` (relative to where it is run): not "pip install" but where the
    repository has the module."""
    lines = refusal(capsys, "relative_path/extends_path_relative.py:Anything")
    text = " ".join(lines)
    assert "it imports 'attnbench_relative_helper', which is not installed here: its repository has it at" in text
    assert "relative_path/helpers/attnbench_relative_helper.py" in text and "pip install" not in text


def test_a_script_is_imported_with_its_own_path_as_sys_argv_0(repo_cwd, capsys):
    """modded-nanogpt reads its own source through ``sys.argv[0]`` at import, as ``python file.py`` runs it."""
    before = list(sys.argv)
    code, out, err = cli(["check", R + "reads_beside_argv.py:ArgvAttention", "--kind", "causality"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert sys.argv == before


def test_a_script_that_parses_its_arguments_at_import_does_not_read_attnbench_s(repo_cwd, capsys, monkeypatch):
    """AI-Scientist's nanoGPT template calls ``parser.parse_args()`` at import: as ``python file.py`` (no arguments)."""
    monkeypatch.setattr(sys, "argv", ["attnbench", "check", "-v", "--kind", "causality"])
    code, out, err = cli(["check", R + "parses_args_at_import.py:ParsedArgsAttention", "--kind", "causality"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert sys.argv == ["attnbench", "check", "-v", "--kind", "causality"]


def test_a_config_field_no_spec_fills_is_guessed_off_and_named(repo_cwd, capsys):
    """LoRA's GPT-2: ``config.lora_attn_alpha`` sizes an add-on no spec field fills; guessed 0 (off), the width ``nx``
    is then solved by a probe and the class passes, with the guess in ``-v``."""
    code, out, err = cli(["check", "-v", R + "config_field.py:LoraFieldAttention", "--kind", "forward,causality"], capsys)
    text = " ".join(out.split())
    assert code == 0 and "PASS" in text, out + err
    assert "lora_attn_alpha (compared with no string in its source: 0, off" in text, text


def test_a_layer_around_an_inner_attention_its_caller_builds_is_refused_as_such(repo_cwd, capsys):
    """Informer's ``AttentionLayer(attention, d_model, n_heads)``: not "'int' object is not callable" after a probe."""
    text = " ".join(" ".join(refusal(capsys, "not_a_layer.py:AroundInner")).split())  # wrapped lines, one text
    assert "AroundInner is not a whole attention layer by itself: its constructor takes 'attention', a module its" in text
    assert "calls (self.inner_attention(...) at" in text and "tests/plugins/refusals/not_a_layer.py:40)" in text
    assert "attnbench adapt FILE:Class" in text and "not callable" not in text


def test_a_kernel_without_weights_is_refused_as_not_a_layer(repo_cwd, capsys):
    """Informer's ``FullAttention``: per-head q, k, v already projected; not "not causal with any mask form"."""
    lines = refusal(capsys, "not_a_layer.py:KernelOnly")
    assert lines[0].startswith("error: KernelOnly is not an attention layer: it has no weight matrices"), lines
    assert "not causal" not in " ".join(lines)


def test_a_file_in_a_folder_without_init_under_a_package_runs_the_package_first(repo_cwd, capsys):
    """nano-vllm's ``nanovllm/layers/attention.py`` (``layers/`` has no ``__init__.py``): imported as
    ``nanovllm.layers.attention``, so the package's ``__init__`` runs first, as Python run from the root does."""
    lines = refusal(capsys, "nspkg/layers/attention.py:Anything")
    assert "it imports 'attnbench_refusals_absent_hash', which is not installed here" in lines[0], lines


def test_a_warning_on_the_way_is_shown_after_the_refusal_whose_first_line_is_the_cause(repo_cwd):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "attnbench", "check", R + "warns_at_import.py:Block"],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[0].startswith("error: Block is a whole block, not an attention layer"), done.stderr
    assert any("UserWarning: this module's layers are deprecated" in line for line in lines[1:]), done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_constructor_that_reaches_cuda_under_one_assignment_is_refused_for_cuda(repo_cwd, capsys):
    lines = refusal(capsys, "cuda_in_constructor.py:Attention")
    assert lines[0] == "error: Attention cannot be built on this machine: it needs CUDA, which this machine does not have"
    assert "an assignment of 'span', 'lanes' tried raised" in "\n".join(lines)


def test_a_headline_ending_in_a_bare_exception_type_takes_the_line_that_says_what_it_was():
    """``... failed: AssertionError:`` with its words on the next line names no cause; the next line joins it."""
    from attnbench.errors import PluginLoadError, refusal_lines

    exc = PluginLoadError("importing plug-in 'train.py' failed: AssertionError:\n"
                          "train.py:3 \"assert torch.cuda.is_available()\"")
    lines = refusal_lines(exc)
    assert lines[0] == "error: importing plug-in 'train.py' failed: AssertionError: train.py:3 " \
                       "\"assert torch.cuda.is_available()\"", lines
    assert refusal_lines(PluginLoadError("no cause here\nsecond"))[0] == "error: no cause here"


def test_a_long_headline_is_not_cut_to_a_bare_exception_type():
    """Cut at its last fitting ``: ``, a long import failure kept only ``... failed: ValueError:``; it keeps the
    exception's words instead (kakaobrain's mutable dataclass default on Python 3.11)."""
    from attnbench.errors import PluginLoadError, refusal_lines

    exc = PluginLoadError("importing plug-in 'rqvae/models/rqtransformer/attentions.py' failed: ValueError: mutable "
                          "default <class 'rqvae.models.rqtransformer.configs.AttentionBlockConfig'> for field block "
                          "is not allowed: use default_factory", details=["at rqvae/models/configs.py:32: @dataclass"])
    lines = refusal_lines(exc)
    assert "ValueError: mutable default" in lines[0] and "for field block is not allowed" in lines[0], lines
    assert any("default_factory" in line for line in lines[1:]), lines


def test_a_class_that_is_no_torch_module_is_refused_as_such_before_its_arguments(repo_cwd, capsys):
    """A NumPy model's attention taking an ``np.random.Generator``: refused for what it is, not for the generator
    (round 18: it led with "does not know what to pass for 'rng'")."""
    lines = refusal(capsys, "numpy_module.py:CausalSelfAttention")
    assert lines[0] == "error: CausalSelfAttention is not a torch.nn.Module (it derives from Module): attnbench checks " \
                       "PyTorch attention layers", lines


def test_a_field_an_installed_library_s_object_lacks_is_named_with_the_library_and_its_version():
    """EAGLE's 4.x-era ``Qwen2Attention`` reads ``config.rope_theta``, which transformers 5's ``Qwen2Config`` does not
    have: the refusal names the library and its version, not only the AttributeError (a field of the user's own
    object says nothing of a library)."""
    transformers = pytest.importorskip("transformers")
    from attnbench.plugins.library_version import written_for_another

    with pytest.raises(AttributeError) as raised:
        transformers.LlamaConfig().a_field_no_version_has  # noqa: B018
    said = written_for_another(raised.value)
    assert said.startswith("it reads LlamaConfig.a_field_no_version_has, which transformers ")
    assert f"transformers {transformers.__version__}'s LlamaConfig does not have" in said

    class Own:
        pass

    with pytest.raises(AttributeError) as raised:
        Own().missing  # noqa: B018
    assert written_for_another(raised.value) is None


def test_a_headline_whose_only_cut_leaves_a_bare_exception_type_keeps_its_words():
    """A long headline with one top-level ": " (after the exception's type) was cut there, so its first line said
    "raises RuntimeError:" and no cause (a held-out corpus's helper scored it a miss); it now wraps after the words."""
    head = ("LlamaAttention.forward raises RuntimeError: mat1 and mat2 shapes cannot be multiplied (10x24 and 48x24) "
            "(forward line 270), however attnbench gives attention_mask")
    first = refusal_lines(PluginLoadError(head, details=["tried"], fix="check it"))[0]
    assert first.startswith("error: LlamaAttention.forward raises RuntimeError: mat1 and mat2 shapes cannot be"), first


def test_a_file_whose_package_needs_a_missing_module_it_does_not_import_itself_is_imported_by_its_path(tmp_path):
    """Stability AI's ``sgm/modules/attention.py``: its package's ``__init__`` imports kornia, the file only torch; it
    was refused as "it imports 'kornia', which is not installed here". It is imported by its path, and says so."""
    from attnbench.plugins.loading import IMPORTED, import_file

    package = tmp_path / "pkg_needing_more" / "modules"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("import attnbench_test_no_such_module  # noqa: F401\n")
    (package / "__init__.py").write_text("")
    (package / "attention.py").write_text("import torch\n\n\nclass Attention(torch.nn.Module):\n    pass\n")
    (package / "relative.py").write_text("from . import attention  # noqa: F401\n")
    module = import_file(str(package / "attention.py"))
    assert module.Attention.__name__ == "Attention"
    assert "its package's __init__ imports 'attnbench_test_no_such_module'" in IMPORTED[module.__name__]
    with pytest.raises(PluginLoadError, match="attnbench_test_no_such_module"):
        import_file(str(package / "relative.py"))  # a relative import needs its package: the refusal stands
