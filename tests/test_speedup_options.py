"""The options around paired speed-ups: ``attnbench run --baseline`` and the ``cpu-flash-rfc`` presets."""

from __future__ import annotations

import pytest

from attnbench.cli import main
from attnbench.runner.engine import make_sweep


def test_cpu_flash_rfc_presets_expand_to_the_rfc_cells():
    inference = make_sweep(preset="cpu-flash-rfc")
    cells = inference.cells()
    assert len(cells) == 8  # 2 implementations x fp32/bf16 x causal/non-causal
    assert {c.impl for c in cells} == {"sdpa_flash", "sdpa_math"}
    assert {(c.dtype, c.causal) for c in cells} == {(d, k) for d in ("float32", "bfloat16") for k in (True, False)}
    assert {(c.batch, c.seq_len, c.num_heads, c.d_model, c.head_dim, c.mode, c.device) for c in cells} == {
        (1, 1024, 25, 1600, 64, "inference", "cpu")}
    assert inference.settings.baseline == "sdpa_math"

    train = make_sweep(preset="cpu-flash-rfc-train")
    cells = train.cells()
    assert len(cells) == 8 and train.settings.baseline == "sdpa_math"
    assert {(c.batch, c.seq_len, c.num_heads, c.head_dim, c.mode) for c in cells} == {
        (4, 1024, 25, 64, "forward+backward")}


def test_run_baseline_flag_sets_the_setting_and_rejects_an_implementation_not_swept(monkeypatch, capsys):
    from attnbench.runner import engine

    seen = {}

    def fake_run(sweep, **kw):  # stop before measuring: the sweep handed to the runner is what is checked
        seen["sweep"] = sweep
        raise SystemExit(0)

    monkeypatch.setattr(engine, "run", fake_run)
    with pytest.raises(SystemExit) as exc:
        main(["run", "--preset", "smoke", "--baseline", "weight_split", "-q"])
    assert exc.value.code == 0 and seen["sweep"].settings.baseline == "weight_split"

    with pytest.raises(SystemExit) as exc:
        main(["run", "--preset", "smoke", "--baseline", "sdpa_math"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "--baseline 'sdpa_math' is not one of the sweep's implementations" in err
    assert len(err.splitlines()) == 1
