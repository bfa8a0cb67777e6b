"""Issue 38: the ``inputs`` axis, stress inputs that show how an implementation's error grows (``--inputs``).

* ``normal``: the workload's own draw (``x ~ N(0, 1)``, ``nn.Linear``-like weights); the default, and the cell keys of
  runs before the axis.
* ``outliers``: the FlashAttention-3 protocol on the layer's input: :data:`OUTLIER_SHARE` (0.1%) of the entries of ``x``
  (chosen by a seeded generator) multiplied by :data:`OUTLIER_FACTOR` (10, FA3's N(0, 10^2) outliers among N(0, 1)
  entries). The outliers are in the layer's input, not in Q/K/V directly: the projections spread each one over its
  token's queries, keys and values. A decode cell's new token is left as drawn.
* ``large-logits``: the correctness matrix's extreme-logit weights (:mod:`attnbench.correctness.properties`): ``W_q``
  and ``W_k`` scaled until the largest score (after the ``1/sqrt(head_dim)`` scale) reaches
  ``EXTREME_LOGIT[dtype]`` (100 in float32 and float64, 20 in float16 and bfloat16). Multi-head attention without
  positional fields only (the scaling reads scores as the plain layer computes them); other cells are skipped with
  the reason.
"""

from __future__ import annotations

import torch

from attnbench.errors import UnavailableError
from attnbench.weights import CanonicalWeights, random_weights

OUTLIER_SHARE, OUTLIER_FACTOR = 1e-3, 10.0
"""``outliers``: the share of the input's entries scaled, and the factor."""


def layer_only(cell) -> None:
    """Block and model cells take normal inputs only (an :class:`UnavailableError`, a skipped row, otherwise)."""
    if getattr(cell, "inputs", "normal") != "normal":
        raise UnavailableError(f"--inputs {cell.inputs} is drawn for the attention layer alone; {cell.scope} scope "
                               "takes normal inputs")


def draw_input(cell, seed: int) -> torch.Tensor:
    """The cell's input in float32 on the CPU, as :func:`attnbench.runner.workload.build_workload` draws it
    (``torch.Generator().manual_seed(seed + 1)``), stressed as ``cell.inputs`` says."""
    g = torch.Generator().manual_seed(seed + 1)
    return stressed_input(cell, torch.randn(cell.batch, cell.seq_len, cell.d_model, generator=g), seed)


def stressed_input(cell, x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` (the cell's prefill or whole input) with ``outliers`` planted when the cell asks for them (a copy);
    ``x`` itself otherwise."""
    if getattr(cell, "inputs", "normal") != "outliers":
        return x
    g = torch.Generator().manual_seed(seed + 3)
    n = max(1, round(OUTLIER_SHARE * x.numel()))
    where = torch.randperm(x.numel(), generator=g)[:n].to(x.device)
    out = x.clone()
    flat = out.view(-1)
    flat[where] = flat[where] * OUTLIER_FACTOR
    return out


def weights(cell, spec, seed: int) -> CanonicalWeights:
    """The canonical weights of the cell's layer: the run's draw (``nn.Linear``-like), for ``large-logits`` scaled
    until the largest score reaches the matrix's extreme logit for the cell's dtype."""
    w = random_weights(spec, seed=seed, scale="linear")
    if getattr(cell, "inputs", "normal") != "large-logits":
        return w
    if cell.num_kv_heads is not None or cell.positional:
        raise UnavailableError("--inputs large-logits scales the scores of multi-head attention without positional "
                               "fields; this cell has grouped kv heads or RoPE/QK-norm/scale/softcap")
    from attnbench.correctness.properties import EXTREME_LOGIT, _extreme_weights  # scipy: only when asked for

    x = draw_input(cell, seed).to(torch.float64)
    scaled, _ = _extreme_weights(x, w, spec.num_heads, EXTREME_LOGIT.get(cell.dtype, 100.0), "overflow")
    return scaled
