"""Issue 48: determinism, batch/chunk/layout invariance stated in every verdict (attnbench.correctness.invariance)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from attnbench.cli.app import cli
from attnbench.correctness import invariance
from attnbench.correctness.matrix import run_matrix

PLANTED = "tests/plugins/invariance.py"


def _by(df, impl: str, kind: str, dtype: str = "float32"):
    rows = df[(df.impl == impl) & (df.kind == kind) & (df.dtype == dtype)]
    assert len(rows) == 1, (impl, kind, dtype)
    return rows.iloc[0]


def test_statement_reads_bitwise_ulps_and_differs():
    a = torch.tensor([1.5, -0.25, 0.0])
    assert invariance.statement(invariance.diff(a, a.clone(), "float32")) == "bitwise"
    one_ulp = torch.tensor([1.5 + 2.0**-23, -0.25, 0.0])  # the spacing of float32 at 1.5
    d = invariance.diff(a, one_ulp, "float32")
    assert (invariance.statement(d), d.ulps) == ("within 1 ulp", 1.0)
    far = invariance.diff(a, torch.tensor([1.5, -0.25, 1e-3]), "float32")
    assert invariance.statement(far) == "differs by 0.00067" and far.rel == pytest.approx(1e-3 / 1.5)
    nan = torch.tensor([float("nan"), 1.0])
    assert invariance.statement(invariance.diff(nan, nan.clone(), "float32")) == "bitwise"


def test_read_is_the_inverse_of_the_message():
    assert invariance.read("within 3 ulps: 10 calls; 1 thread, torch 2.6.0") == {
        "statement": "ulps", "text": "within 3 ulps", "ulps": 3, "differs_by": None, "threads": 1}
    got = invariance.read("declares deterministic but differs by 0.0021: 10 calls; 4 threads, torch 2.6.0")
    assert (got["statement"], got["differs_by"], got["threads"]) == ("differs", 0.0021, 4)


@pytest.fixture
def planted(repo_cwd, matrix_results):
    """The planted classes' determinism and batch-invariance rows (run once per session: ``matrix_results``)."""
    names = [f"{PLANTED}:{c}" for c in ("BatchVariant", "Nondeterministic", "DeclaresInvariant", "PerSequenceLoop")]
    return matrix_results(names, kinds=["deterministic", "batch_invariant"])


def test_batch_variant_reads_not_batch_invariant_and_passes(planted):
    row = _by(planted, f"{PLANTED}:BatchVariant", "batch_invariant")
    assert row.status == "pass" and row.message.startswith("within 1 ulp") and row.error > 0
    assert "row 0 of a batch of 2" in row.message and "1 thread, torch " in row.message
    assert _by(planted, f"{PLANTED}:BatchVariant", "deterministic").message.startswith("bitwise")


def test_nondeterministic_reads_not_deterministic_and_passes(planted):
    row = _by(planted, f"{PLANTED}:Nondeterministic", "deterministic", "bfloat16")
    assert row.status == "pass" and not row.message.startswith("bitwise") and "call 2" in row.message


def test_a_declared_property_that_does_not_hold_fails(planted):
    row = _by(planted, f"{PLANTED}:DeclaresInvariant", "batch_invariant")
    assert row.status == "fail" and row.message.startswith("declares batch_invariant but within 1 ulp")
    assert _by(planted, f"{PLANTED}:DeclaresInvariant", "deterministic").status == "pass"  # declared, and it holds


def test_a_per_sequence_loop_is_bitwise_on_both(planted):
    props = [p for p in invariance.properties(planted) if p["impl"] == f"{PLANTED}:PerSequenceLoop"]
    assert {(p["property"], p["dtype"]) for p in props} == {
        (k, d) for k in ("deterministic", "batch_invariant") for d in ("float32", "bfloat16")}
    assert all(p["holds"] and p["statement"] == "bitwise" and p["threads"] == 1 for p in props)


def test_cache_varlen_and_paged_properties_are_measured():
    df = run_matrix(["kv_concat", "paged_sdpa", "varlen_loop"],
                    kinds=["chunk_invariant", "prefix_reuse", "layout_invariant", "varlen_batch_invariant",
                           "varlen_deterministic"])
    ran = {(r.impl, r.kind): r for r in df.itertuples() if r.status != "skip"}
    assert set(ran) == {("kv_concat", "chunk_invariant"), ("kv_concat", "prefix_reuse"),
                        ("paged_sdpa", "chunk_invariant"), ("paged_sdpa", "prefix_reuse"),
                        ("paged_sdpa", "layout_invariant"), ("varlen_loop", "varlen_batch_invariant"),
                        ("varlen_loop", "varlen_deterministic")}
    assert all(r.status == "pass" for r in ran.values())
    assert "page sizes 16/4/3 x 3 page orders" in ran[("paged_sdpa", "layout_invariant")].message
    assert ran[("varlen_loop", "varlen_batch_invariant")].message.startswith("bitwise")  # each sequence alone
    reasons = df[(df.impl == "kv_concat") & (df.kind == "layout_invariant")].message.iloc[0]
    assert "not a paged cache" in reasons


def test_check_prints_and_writes_the_properties(tmp_path, repo_cwd):
    out = tmp_path / "check.json"
    result = CliRunner().invoke(cli, ["check", f"{PLANTED}:BatchVariant", "--kind", "batch_invariant", "-v",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert f"{PLANTED}:BatchVariant properties (1 thread, torch " in result.output
    assert "batch_invariant float32 within 1 ulp" in result.output
    data = json.loads(out.read_text())
    assert len(data["cases"]) == 2 and {p["property"] for p in data["properties"]} == {"batch_invariant"}
    assert all(not p["holds"] and p["ulps"] == 1 and p["max_relative_difference"] > 0 for p in data["properties"])


def test_run_rows_carry_deterministic_and_batch_invariant(repo_cwd):
    from types import SimpleNamespace

    from attnbench import registry
    from attnbench.runner import properties as run_properties
    from attnbench.spec import AttnSpec

    spec, x = AttnSpec(16, 16, 8, 0.0, 2), torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(0))

    def workload(cls: str, mode: str = "inference"):
        module = registry.get(f"{PLANTED}:{cls}").build(spec).eval()
        return SimpleNamespace(cell=SimpleNamespace(mode=mode, lengths="", scope="layer"), module=module, x=x)

    cols, note = run_properties.columns(workload("BatchVariant"), False, 1e-4)
    assert cols["deterministic"] == "bitwise" and cols["batch_invariant"].startswith("within ") and note is None
    cols, _ = run_properties.columns(workload("Nondeterministic"), False, 1e-4)
    assert cols["deterministic"] != "bitwise"
    assert run_properties.columns(workload("PerSequenceLoop"), False, 1e-4)[0] == {
        "deterministic": "bitwise", "batch_invariant": "bitwise"}
    cols, note = run_properties.columns(workload("BatchVariant"), False, 1.0)  # 8 calls of 1 s: over the budget
    assert cols == {"deterministic": "", "batch_invariant": ""} and "would take over 2 s" in note
    assert run_properties.columns(workload("BatchVariant", "decode"), False, 1e-4) == (
        {"deterministic": "", "batch_invariant": ""}, None)  # not applicable: no note


def test_properties_are_measured_in_the_first_round_and_kept_by_the_merge(tmp_path):
    """Issue 49 (the default run's time): a later round does not measure the two properties again, as it does not
    measure memory or count FLOPs; the merged row keeps the first round's."""
    import attnbench
    from attnbench.runner import properties as run_properties

    calls = []
    real = run_properties.measure

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(run_properties, "measure", counted)
    try:
        df = attnbench.run(impl=["sdpa"], out=tmp_path / "runs", seq_len=[8], batch=[2], num_heads=[2], d_model=[16],
                           settings={"budget_s": 0.02, "warmup_s": 0.0, "warmup_calls": 1, "min_samples": 3,
                                     "threads": 1, "rounds": 2, "accuracy": "off"},
                           executor="inprocess")  # in this process, where the count above sees the calls
    finally:
        mp.undo()
    assert list(df.status) == ["ok"] and df.deterministic.iloc[0] == "bitwise"
    assert df.batch_invariant.iloc[0] in ("bitwise",) or df.batch_invariant.iloc[0].startswith("within ")
    assert len(calls) == 1  # one round measured them
    assert run_properties.merged_columns([{"deterministic": ""}, {"deterministic": "bitwise", "batch_invariant": "x"}]) \
        == {"deterministic": "bitwise", "batch_invariant": "x"}
