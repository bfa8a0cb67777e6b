"""The order of the rows of a fused q/k/v projection, measured on the class, never assumed (issue 46).

nanoGPT's ``c_attn`` holds all queries, then all keys, then all values (``split(C, dim=2)``): the reference's order,
blocks ``[q | k | v]``. GPT-NeoX, Bloom, Megatron and shap-e's ``MultiheadAttention`` view the same projection per head
first (``qkv.view(B, T, heads, 3 * head_dim)``, then split each head's slice into its q, k and v); with grouped-query
attention Megatron and InternLM2 hold, for each kv head, its group's query heads, then its key, then its value. Neither
order is a bug: it is where a checkpoint keeps its rows. A class whose rows are per kv head (:data:`PER_KV_HEAD`) has
them loaded so, and ``check -v`` says so.

The probe: one token (its softmax is 1 whatever its scores, so RoPE, norms and masks do not matter), whose first
feature is 1; row ``r`` of the fused weight, loaded in the reference's order, holds ``r + 1`` in that column, and
``W_o = I``. The class's output in head ``h``'s columns is the number of the row it read head ``h``'s values from,
plus one: ``2·D_q``-ish in blocks, within the head's own group when per kv head. Anything else: the reference's order,
and the cases show what the class does.
"""

from __future__ import annotations

import torch

from attnbench.spec import AttnSpec

PER_KV_HEAD = "per kv head"
FUSED = (("W_q", "W_k", "W_v"), ("b_q", "b_k", "b_v"))
"""The canonical parts of a fused q/k/v projection (its weight, its bias) whose rows this order applies to."""
NOTE = ("its fused q/k/v rows are held per kv head (each group's query heads, then its key, then its value: "
        "GPT-NeoX's and Megatron's order; measured)")


def rows(spec: AttnSpec) -> torch.Tensor:
    """For each row of a per-kv-head fused projection, the row of the reference's ``[q | k | v]`` blocks it holds."""
    heads, kv, hd = spec.num_heads, spec.num_kv_heads or spec.num_heads, spec.head_dim
    rep, d_q, d_kv = heads // kv, heads * hd, kv * hd
    idx: list[int] = []
    for j in range(kv):
        idx += range(j * rep * hd, (j + 1) * rep * hd)
        idx += range(d_q + j * hd, d_q + (j + 1) * hd)
        idx += range(d_q + d_kv + j * hd, d_q + d_kv + (j + 1) * hd)
    return torch.tensor(idx)


def to_class(t: torch.Tensor, spec: AttnSpec) -> torch.Tensor:
    """Fused rows (out axis first) in the reference's order -> per kv head."""
    return t[rows(spec).to(t.device)]


def to_reference(t: torch.Tensor, spec: AttnSpec) -> torch.Tensor:
    """Fused rows per kv head -> the reference's order (the inverse of :func:`to_class`)."""
    out = torch.empty_like(t)
    out[rows(spec).to(t.device)] = t
    return out


def measure(run, to_state, spec: AttnSpec, weights) -> str | None:
    """:data:`PER_KV_HEAD` when the class reads head ``h``'s values from its group's slice of a fused projection,
    ``""`` otherwise, None when it does not run at one token. ``run(state, x)`` loads ``state`` into a class built at
    ``spec`` and returns its output;
    ``weights`` are zero-bias probe weights with ``W_o = I`` (:func:`attnbench.plugins.heads._probe_weights`)."""
    heads, kv, hd = spec.num_heads, spec.num_kv_heads or spec.num_heads, spec.head_dim
    d_q, d_kv = heads * hd, kv * hd
    w = weights
    w.W_q[:, 0] = torch.arange(d_q) + 1.0
    w.W_k[:, 0] = d_q + torch.arange(d_kv) + 1.0
    w.W_v[:, 0] = d_q + d_kv + torch.arange(d_kv) + 1.0
    x = torch.zeros(1, 1, spec.d_in)
    x[..., 0] = 1.0
    try:
        with torch.no_grad():
            out = run(to_state(w, spec), x)
        out = out[0] if isinstance(out, tuple | list) else out
        got = [round(float(v)) - 1 for v in out[0, 0, :d_q]]
    except Exception:  # does not run at one token: nothing measured (the cases show what it does)
        return None
    rep = heads // kv
    per_kv = [j * (rep + 2) * hd + (rep + 1) * hd + d for h in range(heads) for j in [h // rep] for d in range(hd)]
    return PER_KV_HEAD if got == per_kv else ""
