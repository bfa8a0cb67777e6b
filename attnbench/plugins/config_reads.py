"""What a config constructor reads of its config, on a probe: what it reads is what it supports."""

from __future__ import annotations

from dataclasses import replace

from attnbench.plugins.binding import SQUARE_PROBE, Binding, fixed


def config_fields_read(binding: Binding) -> list[str] | None:
    """The config fields a ``Attention(config)`` constructor reads when built on a probe (``None``: not a config
    constructor, or it does not build on the probe)."""
    if binding.style != "config":
        return None
    config = binding.make_config(replace(SQUARE_PROBE, num_kv_heads=2, rope_theta=10000.0))  # a class may need a theta
    config.__dict__["_attnbench_read"] = []
    try:
        binding.target(**{binding.config_param: config}, **fixed(binding.extras))
    except Exception:  # refuses the probe: nothing inferred from its config (the cases show what it does)
        return None
    return list(config.__dict__["_attnbench_read"])
