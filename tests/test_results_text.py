"""How row values read as text: one definition shared by the console, the report and compare."""

from __future__ import annotations

import math
from collections import namedtuple

import pandas as pd
import pytest

from attnbench.results.text import cell_label, configuration_label, fmt_bytes, fmt_ci, fmt_num, fmt_time, time_unit


@pytest.mark.parametrize(("seconds", "text"), [(2.1, "2.1 s"), (0.00123, "1.23 ms"), (4.56e-5, "45.6 µs"),
                                               (3e-9, "3 ns"), (0.0, "0 ns"), (math.nan, "–"), (None, "–")])
def test_fmt_time(seconds, text):
    assert fmt_time(seconds) == text


def test_time_unit_fmt_ci_bytes_and_numbers():
    assert time_unit(0.0042) == (1e-3, "ms") and time_unit(12.0) == (1.0, "s")
    assert fmt_ci(1.49e-5, 2.19e-5) == "14.9–21.9 µs" and fmt_ci(9e-4, 1.2e-3) == "900 µs – 1.2 ms"
    assert fmt_bytes(3 * 2**20) == "3 MiB" and fmt_bytes(-150 * 2**10) == "-150 KiB" and fmt_bytes(12) == "12 B"
    assert fmt_num(1 / 3) == "0.333" and fmt_num(None) == "–" and fmt_bytes(math.nan) == "–"


def test_configuration_label_reads_dicts_pandas_rows_and_named_tuples():
    axes = dict(impl="sdpa", device="cpu", dtype="float32", mode="forward", batch=2, num_heads=4, d_model=64,
                seq_len=128, cache="warm")
    Row = namedtuple("Row", list(axes))
    frame = pd.DataFrame([axes, {**axes, "cache": "cold", "device": "cuda:0"}])
    assert configuration_label(axes) == "cpu/float32/forward (B=2, h=4, d=64)"
    assert configuration_label(Row(**axes)) == configuration_label(axes)
    assert [configuration_label(r) for r in frame.itertuples()][1] == "cuda:0/float32/forward (B=2, h=4, d=64, cache=cold)"
    assert configuration_label(frame.iloc[0]) == configuration_label(axes)
    assert cell_label(axes) == "sdpa @ cpu/float32/forward (B=2, h=4, d=64) T=128"


def test_a_full_attention_window_reads_as_full_whatever_its_key():
    from attnbench.results.text import axis_label

    for full in (None, float("nan"), 0, -1):  # -1: how compare keys full attention when matching cells
        assert axis_label("window", full) == "full attention"
    assert axis_label("window", 64) == "window 64"
