"""Issue 46, item 5: the working precision of the buffers a constructor builds.

``tests/plugins/rope_f32_tables.py:RopeAttention`` computes ``inv_freq`` in float32 in ``__init__`` and finishes
its cos/sin tables in float64: cast with ``.double()``, they are float64 tensors accurate to float32 only, which no
op in ``forward`` shows. Before this, ``check`` failed its float64 cases at 1e-9 with errors of 1e-9 to 5e-8.
"""

from __future__ import annotations

import torch
from torch import nn

from attnbench.correctness import buffers, precision
from tests.plugins.rope_f32_tables import ExactTables, RopeAttention
from tests.test_exit_status import cli  # attnbench ARGV in this process: (exit status, stdout, stderr)

P = "tests/plugins/rope_f32_tables.py:"


def test_tables_from_a_float32_inv_freq_are_float32_accurate_and_exact_ones_are_not():
    found = buffers.float32_accurate(lambda: RopeAttention(32, 32, 64, 4))
    assert set(found) == {"cos", "sin"}, found
    assert all(buffers.FLOAT64_ACCURATE < err < 1e-5 for err in found.values()), found
    assert buffers.float32_accurate(lambda: ExactTables(32, 32, 64, 4)) == {}


class _Mixed(nn.Module):
    """Buffers that must not be read as float32-accurate tables: drawn at random, integers, an additive mask, exact
    float64 values; and one computed from a float32 step (``.to(torch.float32)``) that must be."""

    def __init__(self):
        super().__init__()
        pos = torch.arange(16, dtype=torch.float64)[:, None]
        self.register_buffer("drawn", pos * torch.randn(4))
        self.register_buffer("counts", pos * 2)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
        self.register_buffer("exact", pos / 3)
        self.register_buffer("scaled", pos * (torch.arange(4, dtype=torch.float64) / 7).to(torch.float32))


def test_drawn_integer_masked_and_exact_buffers_are_left_alone():
    assert set(buffers.float32_accurate(_Mixed)) == {"scaled"}


def test_a_float32_valued_buffer_is_left_to_the_observation_that_already_names_it():
    class Float32Tables(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos", torch.cos(torch.arange(32.0) / 3))  # float32 values, cast to float64

    module = Float32Tables().double()
    assert buffers.float32_accurate(Float32Tables) == {}
    assert precision.observe(module, lambda: None, torch.float64).parts == {"RoPE tables": {torch.float32}}


def test_observe_with_a_rebuild_makes_the_float64_working_precision_float32():
    def make():
        return RopeAttention(32, 32, 64, 4)

    module, x = make().double(), torch.randn(2, 16, 32, dtype=torch.float64)
    blind = precision.observe(module, lambda: module(x), torch.float64)
    assert not blind.in_float32  # no op in forward shows the tables' precision
    seen = precision.observe(module, lambda: module(x), torch.float64, rebuild=make)
    assert seen.in_float32 and seen.kinds == {"rope"}
    assert list(seen.parts) == ["buffers cos, sin (built float32-accurate by the constructor)"]
    assert set(seen.buffer_errors) == {"cos", "sin"}
    assert precision.observe(module, lambda: module(x), torch.float32, rebuild=make).parts == {}  # float64 only


def test_check_passes_float32_accurate_tables_naming_them_and_judges_exact_ones_at_float64(repo_cwd, capsys):
    code, out, err = cli(["check", "--kind", "forward,backward,eval_deterministic,shape_sequence",
                          P + "RopeAttention", P + "ExactTables"], capsys)
    assert code == 0, out + err
    lines = out.splitlines()
    f32 = lines.index(next(line for line in lines if line.startswith(P + "RopeAttention: PASS")))
    assert lines[f32 + 1].strip().startswith("working precision: float32 in buffers cos, sin"), out
    exact = lines.index(next(line for line in lines if line.startswith(P + "ExactTables: PASS")))
    assert "working precision" not in lines[exact + 1], out


def test_the_working_precision_of_tables_does_not_excuse_a_bug(repo_cwd):
    from attnbench.correctness.matrix import run_matrix

    df = run_matrix([P + "KeysNotRotated"], kinds=["forward"])
    failed = df[df.status == "fail"]
    assert set(failed.dtype) >= {"float64", "float32"}, df[["shape", "dtype", "status", "error"]]
    assert (failed[failed.dtype == "float64"].tolerance < 1e-5).all()  # relaxed to float32's floor, not further
