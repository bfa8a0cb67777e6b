"""The sweep's ``mask`` axis (issue 37): ``--mask causal,alibi+window:64,document:8`` (:mod:`attnbench.correctness.masks`).

A mask value sets the cell fields its parts name, and only those: ``window:N`` the cell's window, ``causal`` / ``full``
its causality, ``softcap:C`` the softcap in its ``positional`` text, and ``alibi`` / ``prefix:N`` / ``document[:D]`` /
``sink`` its ``mask`` axis (:func:`attnbench.correctness.masks.extra_text`). What a value leaves out keeps the sweep's other axes
(``--mask alibi --window none,64`` sweeps ALiBi with and without a window). Each row records its mask in ``mask``
(the extra kinds; an axis of the cell) and ``mask_label`` (the whole mask: ``causal+window:64+alibi``).
"""

from __future__ import annotations

from dataclasses import replace

from attnbench.correctness import masks
from attnbench.errors import InvalidSpecError, SweepError
from attnbench.spec import AttnSpec, positional_from_text

ORDER = ("causal", "window", "softcap", "alibi", "prefix", "documents_count", "sinks")


def canonical(text: str) -> str:
    """``text`` validated, in the one spelling a sweep keeps (``none`` / ``""``: the sweep's own axes, no mask)."""
    text = str(text).strip().lower()
    if text in ("", "none"):
        return ""
    try:
        fields = masks.parse(text)
    except InvalidSpecError as exc:
        raise SweepError(f"--mask {text!r}: {exc}") from None
    parts = []
    for name in ORDER:
        if name not in fields:
            continue
        value = fields[name]
        if name == "causal":
            parts.append("causal" if value else "full")
        elif name in ("alibi", "sinks"):
            parts.append("alibi" if name == "alibi" else "sink")
        else:
            word = "document" if name == "documents_count" else name
            parts.append(f"{word}:{value:g}" if isinstance(value, float) else f"{word}:{value}")
    return "+".join(parts)


def parse_masks(value) -> tuple[str, ...]:
    """The ``mask`` axis from a flag's text (masks separated by ``,``) or a TOML list."""
    items = list(value) if isinstance(value, list | tuple) else str(value).split(",")
    return tuple(dict.fromkeys(canonical(t) for t in items)) or ("",)


def apply_mask(cell, text: str):
    """``cell`` with the fields mask ``text`` names set (module docstring)."""
    if not text:
        return cell
    fields = masks.parse(text)
    changes: dict = {"mask": masks.extra_text(fields)}
    if "window" in fields:
        changes["window"] = fields["window"]
    if "causal" in fields:
        changes["causal"] = fields["causal"]
    if "softcap" in fields:
        positional = positional_from_text(cell.positional)
        positional["softcap"] = fields["softcap"]
        changes["positional"] = AttnSpec(2, 2, 1, **positional).positional_text()
    if "prefix" in fields and not changes.get("causal", cell.causal):
        raise SweepError(f"--mask {text!r} with --no-causal: a prefix is bidirectional against a causal rest; "
                         "drop --no-causal or the prefix")
    return replace(cell, **changes)


def mask_fields(cell) -> dict:
    """The spec fields of a cell's ``mask`` axis: document boundaries drawn for its context length (seed 0)."""
    context = cell.seq_len + 1 if cell.mode == "decode" else cell.seq_len
    return masks.spec_fields(cell.mask, context) if cell.mask else {}


def mask_columns(cell) -> dict:
    """``flops_count`` (``masked``: the FLOPs count only the pairs the mask keeps) and ``mask_density`` (the kept
    fraction of the ``T x T`` pairs; NaN for decode and for block and model cells) of a timed row."""
    from attnbench.measure.flops import masked_pairs

    if cell.mode == "decode" or cell.scope != "layer":
        return {"flops_count": "masked", "mask_density": float("nan")}
    fields = mask_fields(cell)
    pairs = masked_pairs(cell.seq_len, cell.window, cell.causal, fields.get("prefix"), fields.get("documents"))
    return {"flops_count": "masked", "mask_density": pairs / cell.seq_len ** 2}
