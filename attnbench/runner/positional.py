"""The sweep's ``positional`` axis (issue 26): RoPE, QK-norm, score scale and softcap of every cell, as one text.

A value is :meth:`attnbench.spec.AttnSpec.positional_text` (``"rope_theta=500000;rope_scaling=llama3;qk_norm=head"``,
``""`` = none). ``attnbench run`` builds one from ``--rope-theta``, ``--rope-style``, ``--rope-scaling``,
``--qk-norm``, ``--norm-eps``, ``--score-scale`` and ``--softcap``; a TOML ``[sweep]`` table from the same keys
(``rope_theta = 500000``, ...) or sweeps several with ``positional = ["", "rope_theta=10000"]``.
"""

from __future__ import annotations

from attnbench.errors import InvalidSpecError, SweepError
from attnbench.spec import AttnSpec, positional_from_text

KEYS = {"rope_theta": "rope_theta", "rope_style": "rope_style", "rope_scaling": "rope_scaling", "qk_norm": "qk_norm",
        "norm_eps": "norm_eps", "score_scale": "scale", "softcap": "softcap"}
"""Flag / TOML key (``--score-scale`` is the spec's ``scale``) -> the positional field it sets."""


def canonical(text: str) -> str:
    """``text`` validated and in the one spelling cells and group ids use (``none`` = ``""``)."""
    text = "" if str(text).strip().lower() in ("", "none") else str(text)
    try:
        return AttnSpec(2, 2, 1, **positional_from_text(text)).positional_text()
    except InvalidSpecError as exc:
        raise SweepError(f"positional setting {text!r}: {exc}") from None


def parse_positional(value) -> tuple[str, ...]:
    """The ``positional`` axis from a TOML list or a flag's text (settings separated by ``;``, values by ``,``)."""
    items = list(value) if isinstance(value, list | tuple) else str(value).split(",")
    return tuple(dict.fromkeys(canonical(t) for t in items)) or ("",)


def compose(given: dict) -> str | None:
    """One ``positional`` value from keys of :data:`KEYS` (``None`` when none is set)."""
    given = {k: v for k, v in given.items() if k in KEYS and v is not None}
    if not given:
        return None
    return canonical(";".join(f"{KEYS[k]}={v}" for k, v in given.items()))
