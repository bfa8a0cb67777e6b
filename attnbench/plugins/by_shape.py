"""Projections whose names say no role, bound by their shape on the probe and by what they do (issue 46).

Names bind most classes (:mod:`~attnbench.plugins.layout`). What is left when they do not (an output layer named
``w_concat``, q/k/v as a ``ModuleList`` of three ``nn.Linear``: ``linear_layers``, ``qkv_nets``) is bound here, and only
where it is unambiguous:

* by shape, on the probe spec whose sizes all differ (d_in 20, d_out 24): the one unclaimed ``nn.Linear`` of shape
  ``W_o`` is the output projection; one of ``3 * d_out`` rows reading ``d_in`` is a fused q/k/v; three reading ``d_in``
  are the three projections;
* the three are then told apart by a probe of what each does (:func:`qkv_roles`), never by trying assignments against
  the reference (which would hide a class that swaps q and k): the value projection is the one the output is affine in,
  and the key projection is the one that, made the same for every token, leaves the output unmoved by the other. A
  class the probe cannot read (keys rotated by position before the scores, or no attention at all) is refused with the
  mapping's own message and what the probe found: no order is assumed.

A frozen scalar parameter no name claims (PatchTST's ``scale``, ``requires_grad=False``) is kept as built: it is part of
the class's function, and the cases show whether it is the canonical one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights

QKV = ("W_q", "W_k", "W_v")
QKVO = (*QKV, "W_o")


@dataclass(frozen=True)
class Found:
    """Parameters bound by shape: ``(param, canonical names)`` pairs, and what to say of them."""

    claims: tuple[tuple[str, tuple[str, ...]], ...]
    note: str
    qkv_slots: tuple[str, ...] = ()  # the three (or four) weights in registration order, for a probe to order


def unclaimed_linears(params: dict[str, nn.Parameter], modules: dict[str, nn.Module], taken: set[str]) -> list[str]:
    """The owner paths of the linear modules none of whose parameters is claimed, in registration order: each
    ``nn.Linear``, and each other module whose own parameters are one matrix stored ``(out, in)`` (read so only when
    its shape says so) and at most a bias (a from-scratch ``Linear`` holding ``self.w``), without submodules."""
    owners = []
    for name in params:
        path, _, last = name.rpartition(".")
        module = modules.get(path)
        if module is None or {name, f"{path}.bias"} & taken:
            continue
        if (last == "weight" and isinstance(module, nn.Linear)) or (not isinstance(module, nn.Linear) and
                                                                    not list(module.children()) and
                                                                    _weight(params, path) == name):
            owners.append(path)
    return owners


def _weight(params: dict[str, nn.Parameter], owner: str) -> str | None:
    """The name of ``owner``'s weight: ``owner.weight``, else its one own matrix beside at most a ``bias``."""
    if f"{owner}.weight" in params:
        return f"{owner}.weight" if params[f"{owner}.weight"].dim() == 2 else None
    own = {n: p for n, p in params.items() if n.rpartition(".")[0] == owner}
    matrices = [n for n, p in own.items() if p.dim() == 2]
    rest = set(own) - set(matrices) - {f"{owner}.bias"}
    return matrices[0] if len(matrices) == 1 and not rest else None


def bind(params, modules, taken: set[str], missing: list[str], shapes: dict[str, tuple[int, ...]]) -> list[Found]:
    """What shape alone binds among the unclaimed ``nn.Linear`` modules, for the ``missing`` canonical weights."""
    owners = unclaimed_linears(params, modules, taken)
    found: list[Found] = []
    square = set(QKVO) <= set(missing) and shapes["W_o"] == shapes["W_q"]  # d_in == d_out: W_o's shape is q's
    if "W_o" in missing and not square:
        outs = [o for o in owners if tuple(params[_weight(params, o)].shape) == shapes["W_o"]]
        if len(outs) == 1:
            found.append(Found(_with_bias(params, outs[0], ("W_o",)), f"W_o <- {outs[0]}: the one unnamed nn.Linear of "
                                                                       "its shape"))
            owners.remove(outs[0])
    if set(QKV) <= set(missing):
        d_in = shapes["W_q"][1]
        ins = [o for o in owners if params[_weight(params, o)].shape[1] == d_in]
        rows = [params[_weight(params, o)].shape[0] for o in ins]
        if len(ins) == 1 and rows[0] == sum(shapes[n][0] for n in QKV):
            found.append(Found(_with_bias(params, ins[0], QKV), f"W_q, W_k, W_v <- {ins[0]}: the one unnamed nn.Linear "
                                                                "of their fused shape, in q, k, v order"))
        elif square and len(ins) == 2 and sorted(rows) == sorted([sum(shapes[n][0] for n in QKV), shapes["W_o"][0]]):
            fused = ins[rows.index(sum(shapes[n][0] for n in QKV))]  # sockeye's ff_in beside ff_out, d_in == d_out
            out = next(o for o in ins if o != fused)
            found.append(Found(_with_bias(params, fused, QKV) + _with_bias(params, out, ("W_o",)),
                               f"W_q, W_k, W_v <- {fused}, W_o <- {out}: unnamed nn.Linear of the fused shape (in q, "
                               "k, v order) and of the output's"))
        elif square and len(ins) == 4 and rows == [shapes[n][0] for n in QKVO]:
            claims = tuple(c for o, n in zip(ins, QKVO, strict=True) for c in _with_bias(params, o, (n,)))
            found.append(Found(claims, f"W_q, W_k, W_v, W_o <- {', '.join(ins)}: four unnamed nn.Linear of their "
                                       "shape", qkv_slots=tuple(_weight(params, o) for o in ins)))
        elif _fused_kv(ins, rows, shapes, square) is not None:
            found.append(_fused_kv(ins, rows, shapes, square)(params))
        elif len(ins) == 3 and rows == [shapes[n][0] for n in QKV]:
            claims = tuple(c for o, n in zip(ins, QKV, strict=True) for c in _with_bias(params, o, (n,)))
            found.append(Found(claims, f"W_q, W_k, W_v <- {', '.join(ins)}: three unnamed nn.Linear of their shape",
                               qkv_slots=tuple(_weight(params, o) for o in ins)))
    return found


def _fused_kv(ins: list[str], rows: list[int], shapes: dict, square: bool):
    """Queries apart and keys and values fused (sgrvinod's ``cast_queries``, ``cast_keys_values``, ``cast_output``):
    one unnamed ``nn.Linear`` of ``W_k`` and ``W_v``'s rows together (keys first, as q, k, v are fused), one of the
    queries' rows and, where ``d_in == d_out``, the output after the queries in registration order; a callable
    ``(params) -> Found``, or None when the shapes are not so."""
    kv, q = shapes["W_k"][0] + shapes["W_v"][0], shapes["W_q"][0]
    if rows.count(kv) != 1 or kv == q or sorted(rows) != sorted([kv] + [q] * (2 if square else 1)):
        return None
    fused = ins[rows.index(kv)]
    rest = [o for o, r in zip(ins, rows, strict=True) if o != fused]
    names = ("W_q", "W_o")[:len(rest)]

    def found(params) -> Found:
        claims = _with_bias(params, fused, ("W_k", "W_v")) + tuple(
            c for o, n in zip(rest, names, strict=True) for c in _with_bias(params, o, (n,)))
        said = f"W_q <- {rest[0]}, W_k, W_v <- {fused}" + (f", W_o <- {rest[1]}" if square else "")
        return Found(claims, f"{said}: unnamed nn.Linear of their shapes (keys and values fused, keys first"
                             + ("; the queries' registered before the output's" if square else "") + ")")
    return found


def _with_bias(params, owner: str, canonical: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    weight = ((_weight(params, owner), canonical),)
    return weight + (((f"{owner}.bias", tuple("b" + n[1:] for n in canonical)),) if f"{owner}.bias" in params else ())


def kept_scalars(params: dict[str, nn.Parameter], taken: set[str]) -> list[str]:
    """Frozen one-element parameters no name claims: constants of the class, kept as built."""
    return [n for n, p in params.items() if n not in taken and p.numel() == 1 and not p.requires_grad]


Run = Callable[[CanonicalWeights, torch.Tensor], torch.Tensor]


def qkv_roles(run: Run, spec: AttnSpec, slots: int = 3, seed: int = 0) -> tuple[int, ...] | None:
    """Which of the ``slots`` slots (loaded as canonical W_q, W_k, W_v and, with four, W_o, in registration order) the
    class uses as its query, key, value (and output) projection; None when the probe cannot tell (a class that rotates
    its keys by position, say).

    ``run(w, x)`` loads ``w`` into the class (float64, eval) and returns its output for ``x``."""
    g = torch.Generator().manual_seed(seed)
    d_in, d_out = spec.d_in, spec.d_out
    x = torch.randn(1, 6, d_in, generator=g, dtype=torch.float64)
    x[..., 0] = 1.0  # a coordinate every token shares: a projection reading only it is the same for every token
    mats = [torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5 for _ in range(4)]
    eye = torch.eye(d_out, dtype=torch.float64)

    def out(m: list[torch.Tensor]) -> torch.Tensor:
        w = CanonicalWeights(W_q=m[0], W_k=m[1], W_v=m[2], b_q=None, b_k=None, b_v=None, W_o=m[3] if slots == 4 else eye,
                             b_o=torch.zeros(d_out, dtype=torch.float64))
        with torch.no_grad():
            return run(w, x)

    order = list(range(slots))
    o = None
    if slots == 4:  # the output projection: made rank one, every output lies along its column
        fixed = [j for j in order if _along(out, mats[:4], j, g)]
        if len(fixed) != 1:
            return None
        o = fixed[0]
        order.remove(o)
    found = _qkv_of(lambda m3: out(_placed(m3, order, o, eye)), mats[:3], g, d_out, d_in)
    if found is None:
        return None
    q, k, v = (order[i] for i in found)
    return (q, k, v) if o is None else (q, k, v, o)


def _placed(m3: list[torch.Tensor], order: list[int], o: int | None, eye: torch.Tensor) -> list[torch.Tensor]:
    """Three matrices into the slots ``order``, the identity into the output slot ``o``."""
    if o is None:
        return m3
    m = [eye] * 4
    for slot, t in zip(order, m3, strict=True):
        m[slot] = t
    return m


def _along(out, base: list[torch.Tensor], j: int, g: torch.Generator) -> bool:
    """Whether, with slot ``j`` rank one (column ``a``), every output token lies along ``a``."""
    a = torch.randn(base[j].shape[0], generator=g, dtype=torch.float64)
    b = torch.randn(base[j].shape[1], generator=g, dtype=torch.float64)
    m = list(base)
    m[j] = torch.outer(a, b) / b.norm()
    y = out(m).reshape(-1, a.numel())
    off = y - torch.outer(y @ a / a.dot(a), a)
    return bool(y.abs().max() > 1e-9) and bool(off.abs().max() <= 1e-9 * y.abs().max())


def _qkv_of(out, base: list[torch.Tensor], g: torch.Generator, d_out: int, d_in: int) -> tuple[int, int, int] | None:
    """Indices of the query, key and value among three slots, or None."""
    affine = [_affine(out, base, j) for j in range(3)]
    if affine.count(True) != 1:
        return None
    v = affine.index(True)
    a, b = (j for j in range(3) if j != v)
    same = torch.zeros(d_out, d_in, dtype=torch.float64)
    same[:, 0] = torch.randn(d_out, generator=g, dtype=torch.float64)
    others = [torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5 for _ in range(2)]
    a_is_k, b_is_k = (_unmoved(out, base, key, other, same, others) for key, other in ((a, b), (b, a)))
    if a_is_k == b_is_k:
        return None
    k, q = (a, b) if a_is_k else (b, a)
    return q, k, v


def _affine(out, base: list[torch.Tensor], j: int) -> bool:
    """Whether the output is affine in slot ``j`` (a value projection) and moves with it."""
    def scaled(c):
        return out([m * c if i == j else m for i, m in enumerate(base)])

    o0, o1, o2 = scaled(0.0), scaled(1.0), scaled(2.0)
    return not torch.allclose(o1, o0, atol=1e-9) and torch.allclose(o2 - o0, 2 * (o1 - o0), rtol=1e-7, atol=1e-10)


def _unmoved(out, base: list[torch.Tensor], key: int, other: int, same: torch.Tensor, others: list[torch.Tensor]) -> bool:
    """Whether, with slot ``key`` the same for every token, the output does not move when slot ``other`` changes."""
    outs = []
    for m in others:
        slots = list(base)
        slots[key], slots[other] = same, m
        outs.append(out(slots))
    return torch.allclose(outs[0], outs[1], rtol=1e-9, atol=1e-10)


def assign(sources: tuple, slots: tuple[str, ...], roles: tuple[int, ...]) -> tuple[tuple, str]:
    """``sources`` with the three (or four) ``slots`` and their biases holding W_q, W_k, W_v (and W_o) as ``roles`` says
    (slot indices of the query, key, value and output), and the line that says how."""
    owners = [s.rpartition(".")[0] for s in slots]
    names = QKVO[:len(slots)]
    role_of = {owners[slot]: name for slot, name in zip(roles, names, strict=True)}
    out = []
    for s in sources:
        owner, _, last = s.param.rpartition(".")
        if s.constant or owner not in role_of:
            out.append(s)
            continue
        name = role_of[owner] if last == "weight" else "b" + role_of[owner][1:]
        out.append(dataclasses.replace(s, canonical=(name,)))
    said = ", ".join(f"{name[-1]} <- {owners[slot]}" for slot, name in zip(roles, names, strict=True))
    return tuple(out), (f"{said}: measured (" + ("o made rank one, every output lies along its column; "
                                                 if len(slots) == 4 else "") +
                        "the output is affine in v; with k the same for every token, q does not move it)")
