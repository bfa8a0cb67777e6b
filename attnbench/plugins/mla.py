"""Multi-head latent attention (MLA, DeepSeek style; the book's chapter-4 ``MultiHeadLatentAttention``): keys and
values through a low-rank latent, ``W_DKV`` down to ``latent_dim``, then ``W_UK``/``W_UV`` up.

Its keys are ``W_UK @ W_DKV x`` (plus ``W_UK b_DKV + b_UK``): a rank-``latent_dim`` matrix, so canonical weights
(full rank) cannot be loaded into it. The one direction a low-rank layer allows is module -> canonical: the
reference takes its weights *from the module*, ``W_k = W_UK @ W_DKV`` and ``b_k = W_UK @ b_DKV + b_UK`` (``W_v``
likewise). To draw other weights for every seed, the layer's factors are set from the canonical draw
deterministically (``W_DKV`` = the first ``latent_dim`` rows of ``[W_k; W_v]``, ``W_UK`` = the first
``latent_dim`` columns of ``W_k``, ...), and the weights every reference uses are read back composed
(``composed = True`` on the layout: :func:`attnbench.correctness.cases.build` exports them). Gradients of a
composed weight have no canonical counterpart, so such a class declares no backward (its gradients w.r.t. the
input are still those of the forward it computes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from attnbench.spec import AttnSpec

_DOWN = {"wdkv", "dkv", "kvdown", "downkv", "kvdownproj", "wkva", "kvaproj", "wdownkv"}
_UP_K = {"wuk", "uk", "kup", "upk", "kupproj", "wkb", "wupk"}
_UP_V = {"wuv", "uv", "vup", "upv", "vupproj", "wvb", "wupv"}
LATENT_RATIO = 4
"""``latent_dim = d_out // LATENT_RATIO`` (at least 1): what a constructor's ``latent_dim``/``kv_lora_rank`` gets."""


def latent_dim(spec: AttnSpec) -> int:
    return max(1, spec.d_out // LATENT_RATIO)


def _kind(path: str) -> str | None:
    token = re.sub(r"[^a-z]", "", path.rsplit(".", 1)[-1].lower())
    return "down" if token in _DOWN else "up_k" if token in _UP_K else "up_v" if token in _UP_V else None


@dataclass(frozen=True)
class LowRank:
    """The module paths of the down- and up-projections (``nn.Linear``: weight (out, in), optional bias)."""

    down: str
    up_k: str
    up_v: str
    biases: frozenset[str] = frozenset()  # which of down/up_k/up_v have a bias

    def params(self) -> set[str]:
        return {f"{p}.weight" for p in (self.down, self.up_k, self.up_v)} | {f"{p}.bias" for p in self.biases}

    def to_state(self, w, spec: AttnSpec, latent: int) -> dict[str, torch.Tensor]:
        """The factors as a deterministic function of ``w`` (see the module docstring)."""
        if latent > spec.d_in or latent > 2 * spec.kv_dim:
            raise ValueError(f"latent_dim {latent} exceeds d_in={spec.d_in} or 2 * kv width {2 * spec.kv_dim}")
        state = {f"{self.down}.weight": torch.cat([w.W_k, w.W_v])[:latent],
                 f"{self.up_k}.weight": w.W_k[:, :latent], f"{self.up_v}.weight": w.W_v[:, :latent]}
        zeros = torch.zeros_like(w.W_k[:, 0])
        values = {self.down: torch.cat([zeros, zeros])[:latent], self.up_k: w.b_k if w.b_k is not None else zeros,
                  self.up_v: w.b_v if w.b_v is not None else zeros}
        state.update({f"{p}.bias": values[p] for p in self.biases})
        return state

    def compose(self, state) -> dict[str, torch.Tensor]:
        """``W_k, b_k, W_v, b_v`` the module computes with."""
        down = state[f"{self.down}.weight"]
        b_down = state.get(f"{self.down}.bias")
        out = {}
        for up, name in ((self.up_k, "k"), (self.up_v, "v")):
            W_up = state[f"{up}.weight"]
            b = W_up @ b_down if b_down is not None else torch.zeros_like(W_up[:, 0])
            out[f"W_{name}"] = W_up @ down
            out[f"b_{name}"] = b + state[f"{up}.bias"] if f"{up}.bias" in state else b
        return out

    def describe(self) -> list[str]:
        return [f"W_k <- {self.up_k}.weight @ {self.down}.weight, W_v <- {self.up_v}.weight @ {self.down}.weight "
                f"(low-rank latent: the reference takes these from the module)",
                "b_k <- W_UK b_DKV + b_UK, b_v likewise (composed)"]


def find_low_rank(modules: dict, spec: AttnSpec) -> LowRank | None:
    """The down/up projections of an MLA layer (by name: ``W_DKV``/``kv_down``/``wkv_a``, ``W_UK``/``k_up``/
    ``wk_b``, ``W_UV``/``v_up``/``wv_b``), or ``None``."""
    found: dict[str, str] = {}
    for path, m in modules.items():
        kind = _kind(path) if path else None
        if kind is not None and isinstance(m, torch.nn.Linear):
            found.setdefault(kind, path)
    if set(found) != {"down", "up_k", "up_v"}:
        return None
    biases = frozenset(p for p in found.values() if modules[p].bias is not None)
    return LowRank(found["down"], found["up_k"], found["up_v"], biases)
