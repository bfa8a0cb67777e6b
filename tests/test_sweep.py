"""Sweep definitions: ranges, TOML files, presets, invalid combinations."""

import pytest

from attnbench import registry
from attnbench.errors import SweepError, UnavailableError, UnknownImplementationError
from attnbench.runner.engine import default_sweep, make_sweep
from attnbench.runner.sweep import parse_ints, preset_names


@pytest.mark.parametrize("text, values", [
    ("1,8", (1, 8)), ("128..2048x2", (128, 256, 512, 1024, 2048)), ("64..256+64", (64, 128, 192, 256)),
    ("5", (5,)), ("3..3", (3,)), ([4, 2], (4, 2)), ("1..20x3", (1, 3, 9)),
])
def test_parse_ints(text, values):
    assert parse_ints(text, "seq_len") == values


@pytest.mark.parametrize("text, fragment", [
    ("0", "--seq 0: values must be >= 1"), ("10..5", "end 5 is below the start 10"),
    ("1..8x1", "step must be >= 2"), ("abc", "not an integer"), ("0..8x2", "start must be >= 1"), ("", "empty"),
])
def test_parse_ints_rejects_bad_ranges_with_a_clear_message(text, fragment):
    with pytest.raises(SweepError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_ints(text, "seq_len")


def test_default_sweep_covers_every_mha_family():
    """Every available built-in that is not a GQA / sliding-window / KV-cache variant (those have presets)."""
    sweep = default_sweep()
    variants = {n for n in registry.available("cpu")
                if (lambda i: i.gqa or i.sliding_window or i.kv_cache or i.varlen)(registry.get(n))}
    assert variants, "the variant built-ins are registered"
    assert set(sweep.impl) == (set(registry.available("cpu")) - variants) | {"compiled:weight_split"}
    assert sweep.device == ("cpu",)
    assert len(sweep.cells()) == len(sweep.impl) * len(sweep.seq_len) * len(sweep.mode)


def test_presets_load():
    assert {"default", "smoke", "gpt2-small", "long-context"} <= set(preset_names())
    gpt2 = make_sweep(preset="gpt2-small")
    assert gpt2.batch == (8,) and gpt2.seq_len == (1024,) and gpt2.d_model == (768,) and gpt2.num_heads == (12,)
    assert make_sweep(preset="long-context").seq_len == (256, 512, 1024, 2048, 4096)
    with pytest.raises(SweepError, match="unknown preset"):
        make_sweep(preset="nope")


def test_toml_file_with_flag_overrides(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text('[sweep]\nimpl = ["sdpa"]\nseq = "64..256x2"\nheads = 2\nd_model = 32\n'
                 'mode = ["inference", "forward"]\n[measure]\nbudget_s = 0.3\n')
    s = make_sweep(file=f, batch="1,4")
    assert s.impl == ("sdpa",) and s.seq_len == (64, 128, 256) and s.batch == (1, 4)
    assert s.settings.budget_s == 0.3 and s.mode == ("inference", "forward")
    assert len(s.cells()) == 3 * 2 * 2


@pytest.mark.parametrize("body, fragment", [
    ("[sweep]\nimpl = 'sdpa'\nbogus = 1\n", "unknown sweep axis 'bogus'"),
    ("[sweep]\nimpl = 'sdpa'\n[measure]\nspeed = 1\n", "unknown \\[measure\\] setting"),
    ("[sweep\nimpl=", "not valid TOML"),
    ("[other]\nx = 1\n", "unknown table"),
])
def test_bad_toml_files(tmp_path, body, fragment):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(SweepError, match=fragment):
        make_sweep(file=f)


def test_unknown_names_fail_before_running():
    with pytest.raises(UnknownImplementationError, match="did you mean"):
        make_sweep(impl="weight_splt")
    with pytest.raises(SweepError, match="unknown dtype"):
        make_sweep(impl="sdpa", dtype="fp8")
    with pytest.raises(SweepError, match="unknown mode"):
        make_sweep(impl="sdpa", mode="training")
    with pytest.raises(SweepError, match="unknown device"):
        make_sweep(impl="sdpa", device="tpu")


def test_cuda_without_cuda_is_one_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(UnavailableError, match="CUDA is not available"):
        make_sweep(impl="sdpa", device="cuda")


def test_cpu_cells_have_only_the_warm_cache_state():
    s = make_sweep(impl="sdpa", cache="warm,cold")
    assert {c.cache for c in s.cells()} == {"warm"}
