"""The correctness matrix: correct implementations pass every case, each shipped kind of bug is flagged."""

from __future__ import annotations

import ast
import importlib.metadata
import math

import pandas as pd
import pytest

from attnbench import registry
from attnbench.correctness.cases import computes_mla
from attnbench.correctness.mask_cases import MASK_SHAPES
from attnbench.correctness.matrix import RUNNERS, SHAPES, VARIANT_SHAPES, cases, run_case, run_matrix, summarize
from attnbench.correctness.mla_cases import MLA_SHAPES
from attnbench.correctness.positional import POSITIONAL_SHAPES
from attnbench.errors import UnknownImplementationError

pytestmark = pytest.mark.usefixtures("single_thread")

BAD = ("fail", "error")
GOOD_PLUGINS = ["tests/plugins/good.py:PlainAttention", "tests/plugins/good.py:SDPAAttention",
                "tests/plugins/buggy.py:Baseline"]


def _flagged(df: pd.DataFrame) -> pd.DataFrame:
    return df[df.status.isin(BAD)]


def _rows(df: pd.DataFrame, kind: str, shape: str | None = None) -> pd.DataFrame:
    """The cases of ``kind`` (and ``shape``) that ran: skips (variants a plug-in does not declare) left out."""
    out = df[(df.kind == kind) & (df.status != "skip")]
    return out if shape is None else out[out["shape"] == shape]


def _describe(df: pd.DataFrame) -> str:
    return "\n".join(f"{r.status} {r.kind} {r.shape} {r.dtype}: {r.message}" for r in _flagged(df).itertuples())


# --- the matrix itself ---------------------------------------------------------------------------

def test_cases_cover_every_kind_and_filter():
    all_cases = cases()
    assert {c.kind for c in all_cases} == set(RUNNERS)
    assert {c.shape.id for c in cases(["forward"])} == {s.id for s in SHAPES + VARIANT_SHAPES + POSITIONAL_SHAPES
                                                        + MASK_SHAPES + MLA_SHAPES}
    assert any(s.spec.d_in != s.spec.d_out for s in SHAPES), "the grid must expose d_in != d_out bugs"
    assert any(s.spec.num_heads > 1 for s in SHAPES) and any(s.spec.num_heads == 1 for s in SHAPES)
    only = cases(kinds=["causality", "backward"])
    assert only and {c.kind for c in only} == {"causality", "backward"}
    assert len(cases(kinds=["golden"])) == 1


def test_unknown_name_raises_before_running_anything():
    seen = []
    with pytest.raises(UnknownImplementationError, match="weight_split"):
        run_matrix(["weight_split", "weight_splt"], progress=seen.append)
    assert seen == []


def test_summarize_counts(repo_cwd, matrix_results):
    df = matrix_results(["tests/plugins/buggy.py:DropoutIgnored"], kinds=["forward", "dropout_train"])
    summary = summarize(df)
    assert set(summary.columns) >= {"impl", "kind", "dtype", "cases", "passed", "failed", "errors", "skipped"}
    assert summary.cases.sum() == len(df)
    assert (summary.passed + summary.failed + summary.errors + summary.skipped == summary.cases).all()
    row = summary[summary.kind == "dropout_train"].iloc[0]
    assert (row.failed, row.passed) == (1, 0)
    assert summary[summary.kind == "forward"].failed.sum() == 0


# --- correct implementations pass everything -----------------------------------------------------

@pytest.mark.parametrize("name", GOOD_PLUGINS)
def test_correct_plugins_pass_every_case(repo_cwd, matrix_results, name):
    df = matrix_results([name])
    assert len(df) == len(cases())
    assert _flagged(df).empty, _describe(df)
    unsupported = df.message.str.contains("does not support")  # GQA/window/non-causal/decode cases: not declared
    assert (df.status == "pass").sum() + unsupported.sum() >= len(df) - 1  # and golden: not one of the book's classes


SLOW_ON_CPU = ("flex", "rope_")
"""Eager FlexAttention takes about 1 s per case on 2 cores (~30 s a matrix): its full matrix runs in the slow set,
and test_flex_forward_and_causality_on_cpu keeps a fast check of it (mask_flex, varlen_flex: flex too, with issue 48's
property cases about 55 s a matrix). The rope family's full matrices are slow too
(the plain cases are those of gqa/sdpa_cache); tests/test_rope_bugs.py runs its positional cases in the fast set."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith(SLOW_ON_CPU) or "flex" in n else n
                                  for n in registry.available("cpu")])
def test_builtin_passes_matrix_on_cpu(matrix_results, name):
    df = matrix_results([name], device="cpu")
    assert _flagged(df).empty, _describe(df)
    judged = "varlen" if registry.get(name).varlen else "forward"  # issue 37: varlen implementations take only varlen cases
    if computes_mla(registry.get(name)):  # issue 46: DeepSeek MLA runs only the MLA shapes (decode ones at least)
        judged = "decode"
    assert (_rows(df, judged).status == "pass").any(), f"{name} skipped every {judged} case"
    for r in df[df.status == "skip"].itertuples():
        assert r.message, f"{name} skipped {r.kind} {r.shape} without a reason"


@pytest.mark.parametrize("name", [n for n in registry.available("cpu") if n.startswith(SLOW_ON_CPU)])
def test_flex_forward_and_causality_on_cpu(name):
    chosen = [c for c in cases(["forward", "causality"]) if c.dtype == "float64" or c.shape.id == "gqa"]
    chosen = [c for c in chosen if c.shape.id in ("oddT_din_ne_dout", "gqa", "window", "props")]
    results = [run_case(name, case) for case in chosen]
    assert {r.kind for r in results if r.status == "pass"} == {"forward", "causality"}
    assert all(r.status in ("pass", "skip") for r in results), [(r.kind, r.shape, r.message) for r in results]


@pytest.mark.cuda
@pytest.mark.parametrize("name", registry.names())
def test_builtin_passes_matrix_on_cuda(cuda_device, name):
    reason = registry.get(name).unavailable_reason(cuda_device)
    if reason:
        pytest.skip(f"{name} is unavailable on CUDA here: {reason}")
    df = run_matrix([name], device=cuda_device)
    assert _flagged(df).empty, _describe(df)
    assert (_rows(df, "forward").status == "pass").any()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["compiled:weight_split", "compiled:sdpa"])
def test_compiled_passes_forward_and_backward(name):
    chosen = [c for c in cases(kinds=["forward", "backward"])
              if c.dtype == "float32" and c.shape.id == "oddT_din_ne_dout"]
    assert {c.kind for c in chosen} == {"forward", "backward"}
    for case in chosen:
        result = run_case(name, case)
        assert result.status == "pass", f"{name} {case.kind}: {result.status} {result.message}"


# --- each buggy plug-in is flagged, by the case that should catch it -------------------------------

def _expect_inverted_mask(df):
    assert (_rows(df, "causality").status == "fail").all()
    assert _rows(df, "forward", "book_hd1").status.isin(BAD).all()


def _expect_no_mask(df):
    assert (_rows(df, "causality").status == "fail").all()
    assert _rows(df, "forward", "oddT_din_ne_dout").status.isin(BAD).all()
    # a single token has no future to leak: the T == 1 shape cannot see this bug
    assert (_rows(df, "forward", "b1_T1").status == "pass").all()


def _expect_scale_by_dout(df):
    assert _rows(df, "forward", "oddT_din_ne_dout").status.isin(BAD).all()  # 4 heads
    assert (_rows(df, "forward", "one_head_bias").status == "pass").all()  # sqrt(d_out) == sqrt(head_dim)
    assert (_rows(df, "causality").status == "pass").all()


def _expect_no_scale(df):
    assert _rows(df, "forward", "hd64_square").status.isin(BAD).all()
    assert (_rows(df, "forward", "book_hd1").status == "pass").all()  # head_dim 1: sqrt(1) == 1


def _expect_heads_mixed(df):
    assert _rows(df, "forward", "book_hd1").status.isin(BAD).all()
    assert (_rows(df, "forward", "one_head_bias").status == "pass").all()  # one head: nothing to mix


def _expect_weight_orientation(df):
    non_square = _rows(df, "forward", "oddT_din_ne_dout")
    assert (non_square.status == "error").all() and non_square.message.str.contains("Error").all()
    assert _rows(df, "forward", "gpt_like").status.isin(BAD).all()  # square: runs, wrong values


def _expect_wrong_grad(df):
    assert (_rows(df, "forward").status == "pass").all()
    assert _rows(df, "backward").status.isin(BAD).all()
    assert _rows(df, "backward").message.str.startswith("grad ").all()


def _expect_dropout_ignored(df):
    assert _flagged(df).kind.unique().tolist() == ["dropout_train"]
    assert "dropout" in _rows(df, "dropout_train").message.iloc[0]


def _expect_dropout_in_eval(df):
    kinds = _flagged(df).kind.unique().tolist()
    assert "eval_deterministic" in kinds and set(kinds) <= {"eval_deterministic", "dropout_mean"}  # eval is dropped too


def _expect_non_finite(df):
    fwd = _rows(df, "forward")
    assert (fwd.status == "fail").all() and (fwd.error == math.inf).all()


def _expect_squeezed_batch(df):
    single = _rows(df, "forward", "b1_T1")
    assert (single.status == "fail").all() and single.message.str.contains("output shape").all()
    assert (_rows(df, "forward", "oddT_din_ne_dout").status == "pass").all()  # batch 3 is untouched


BUGS = {
    "InvertedMaskSDPA": _expect_inverted_mask,
    "NoMask": _expect_no_mask,
    "ScaleByDout": _expect_scale_by_dout,
    "NoScale": _expect_no_scale,
    "HeadsMixedByView": _expect_heads_mixed,
    "WeightOrientation": _expect_weight_orientation,
    "WrongSoftmaxGrad": _expect_wrong_grad,
    "DropoutIgnored": _expect_dropout_ignored,
    "DropoutInEval": _expect_dropout_in_eval,
    "NonFiniteMask": _expect_non_finite,
    "SqueezedBatch": _expect_squeezed_batch,
}


@pytest.mark.parametrize("cls", list(BUGS))
def test_buggy_plugin_is_flagged(repo_cwd, matrix_results, cls):
    df = matrix_results([f"tests/plugins/buggy.py:{cls}"])
    assert not _flagged(df).empty, f"{cls} passed every case"
    BUGS[cls](df)


def test_every_buggy_class_is_tested(repo_cwd):
    tree = ast.parse((repo_cwd / "tests/plugins/buggy.py").read_text())
    variants = {node.name for node in tree.body if isinstance(node, ast.ClassDef)
                and any(isinstance(b, ast.Name) and b.id == "Baseline" for b in node.bases)}
    assert variants == set(BUGS)
    assert registry.get("tests/plugins/buggy.py:Baseline").origin == "file"


def test_buggy_plugin_as_module_class(plugins_on_path, isolated_registry):
    df = run_matrix(["buggy:HeadsMixedByView"], kinds=["forward"])
    assert registry.get("buggy:HeadsMixedByView").origin == "module"
    _expect_heads_mixed(df)


def test_buggy_plugin_as_entry_point(plugins_on_path, isolated_registry, monkeypatch):
    group = registry.ENTRY_POINT_GROUP
    eps = [importlib.metadata.EntryPoint(name="shipped_sdpa", value="buggy:InvertedMaskSDPA", group=group),
           importlib.metadata.EntryPoint(name="my_good_sdpa", value="good:SDPAAttention", group=group)]
    calls = []

    def fake_entry_points(**kwargs):
        calls.append(kwargs)
        return [ep for ep in eps if ep.group == kwargs.get("group")]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    assert {"shipped_sdpa", "my_good_sdpa"} <= set(registry.names())
    assert calls == [{"group": group}]
    assert registry.get("shipped_sdpa").origin == "entry-point"

    df = run_matrix(["shipped_sdpa", "my_good_sdpa"], kinds=["forward", "causality"])
    _expect_inverted_mask(df[df.impl == "shipped_sdpa"])
    assert _flagged(df[df.impl == "my_good_sdpa"]).empty, _describe(df)


def test_declared_capabilities_turn_cases_into_skips(isolated_registry, repo_cwd):
    """A class that says it has no dropout/backward is skipped there, not failed (and the skip says why)."""
    from attnbench.correctness.matrix import PROPERTY_SHAPE, Case

    base = registry.get("tests/plugins/buggy.py:DropoutIgnored")
    registry.register("no_dropout_declared", base.factory, description="declares no dropout", dropout=False,
                      backward=False)
    impl = registry.get("no_dropout_declared")
    for kind in ("dropout_train", "backward"):
        result = run_case(impl, Case(kind, PROPERTY_SHAPE if kind == "dropout_train" else SHAPES[0],
                                     "float32"))
        assert result.status == "skip" and "declares no" in result.message
    assert run_case(base, Case("dropout_train", PROPERTY_SHAPE, "float32")).status == "fail"


def test_constructor_error_is_an_error_row(repo_cwd):
    result = run_case("tests/plugins/bad.py:RaisesInInit", cases(["forward"])[0])
    assert result.status == "error"
    assert "PluginLoadError" in result.message and "refuses to be built" in result.message


def test_session_matrix_cache_returns_what_run_matrix_does(matrix_results):
    """The tests' cache (conftest.matrix_results) gives run_matrix's rows, in its order, for the kinds asked."""
    kinds = ["golden", "causality", "forward"]
    first = matrix_results(["weight_split"], kinds=kinds)
    again = matrix_results(["weight_split"], kinds=["forward"])
    want = run_matrix(["weight_split"], kinds=kinds)
    pd.testing.assert_frame_equal(first.reset_index(drop=True), want.reset_index(drop=True))
    assert set(again.kind) == {"forward"} and len(again) == (want.kind == "forward").sum()
    first.loc[:, "status"] = "edited"  # a test changing its copy changes nothing for the next
    assert (matrix_results(["weight_split"], kinds=["golden"]).status == "pass").all()
