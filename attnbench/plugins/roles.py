"""Constructor parameters whose names say nothing attnbench knows, given their role by probes.

``MultiHeadAttention(n_state: int, n_head: int)``, ``Attn(width, nh, max_t)``: the names are the author's, and no
table of aliases (:data:`~attnbench.plugins.aliases.ALIASES`) can hold them all. Each unknown required parameter gets
candidate *roles* (the spec fields a constructor can take: width, heads, kv heads, head dim, context length, dropout,
bias), ordered by what its name and annotation hint; then probes decide. An assignment is kept when the class builds
with it at two probe sizes and its weight matrices hold exactly as many elements as multi-head attention of that size
has (``d_in·d_out`` for the queries, ``d_in·kv_heads·head_dim`` each for keys and values, ``d_out·d_out`` for the output,
fused or not); a class whose forward takes only ``x`` must also return ``(B, T, d_out)``. The first assignment that
passes, in hint order, wins; ``check -v`` prints it with what the probe saw.
"""

from __future__ import annotations

import inspect
import itertools
import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from attnbench.spec import AttnSpec

INT_ROLES = ("d_in", "num_heads", "num_kv_heads", "head_dim", "context_length")
HINTS: dict[str, tuple[str, ...]] = {
    "d_in": ("dim", "state", "embd", "embed", "emb", "width", "hidden", "model", "channels", "feat", "size", "d"),
    "num_heads": ("head", "nh", "heads"),
    "num_kv_heads": ("kv", "group", "query_groups"),
    "head_dim": ("head_dim", "head_size", "dk", "dh", "hd"),
    "context_length": ("ctx", "len", "block", "pos", "seq", "max", "context", "window"),
    "dropout": ("drop", "pdrop", "p"),
    "qkv_bias": ("bias",),
    "d_context": ("context", "ctx", "cross", "encoder", "cond", "memory", "kv", "dim"),
    "d_out": ("out", "output"),
    "d_ff": ("ff", "ffn", "mlp", "feedforward", "feed", "intermediate", "inner", "hidden"),
}
"""Fragments of a parameter's name that make a role its first candidate (probes still decide). ``d_context`` is the
width of a second input (cross-attention's ``context_dim``): ``d_in`` again, for self-attention; it is a candidate only
for a name that hints at it, beside a parameter that takes ``d_in``. ``d_out`` (an output width, VITS's
``out_channels``) likewise, for a name that says out. ``d_ff`` (a feed-forward width, ``4 * d_in``) is a candidate
for a name that says feed-forward or hidden: an attention layer has none, so a class built with one is a whole block
(STORM's ``AttentionBlock(feat_dim, hidden_dim, num_heads, dropout)``), refused as such. An assignment with two
widths must fit where they differ too; one that fits only where they are equal (VITS's queries are ``channels`` wide
and its output ``out_channels``, g-mlp's output ``dim_out`` and its inner ``dim_inner``: the same function only when
the widths are equal) is kept when no other fits, and the class is checked at one width."""
PROBES = (AttnSpec(d_in=24, d_out=24, context_length=9, dropout=0.0, num_heads=4, num_kv_heads=2, rope_theta=10000.0),
          AttnSpec(d_in=40, d_out=40, context_length=11, dropout=0.0, num_heads=5, rope_theta=10000.0))
"""Two sizes with every int distinct (24/4/2/6/9, 40/5/5/8/11): a wrong assignment changes a weight's size. A theta
is set, as the first build sets one (plugins.stages.construct): a constructor that takes a base builds its tables."""
MAX_TRIES = 120
PATH_WORDS = {"file", "path", "dir", "vocab", "tokenizer", "ckpt", "checkpoint", "url", "filename", "fname", "root"}
"""Words that make a parameter a path: no probe gives it an int."""
BUILT: dict = {}
"""Class -> (module, spec) of the first role assignment that built it, for the refusal of one that fits none."""


@dataclass(frozen=True)
class Solved:
    """Roles found for a constructor's unknown parameters, and the words ``check -v`` prints about them."""

    params: tuple[tuple[str, str], ...]
    note: str
    one_width: bool = False  # it fits only where d_in == d_out: checked at one width


def _annotation(p: inspect.Parameter):
    ann = p.annotation
    return {"int": int, "float": float, "bool": bool}.get(ann, ann) if isinstance(ann, str) else ann


def solvable(p: inspect.Parameter) -> bool:
    """Can a probe give ``p`` a role: unannotated, or annotated ``int``, ``float`` or ``bool`` (a ``str`` layout name, a
    tuple or a module is for the user to say: ``attnbench adapt``)?"""
    words = set(re.split(r"[_\d]+", p.name.lower()))
    if words & PATH_WORDS:  # a small int given to open() closes a standard stream: never probed
        return False
    return _annotation(p) in (inspect.Parameter.empty, int, float, bool)


def _score(p: inspect.Parameter, role: str) -> int:
    return score_name(p.name, role)


def score_name(name: str, role: str) -> int:
    """How strongly the words of ``name`` hint at ``role`` (:data:`HINTS`): 3 per whole word, 1 per fragment."""
    words = [w for w in re.split(r"[_\d]+", name.lower()) if w] or [name.lower()]
    return sum(_hint(w, HINTS[role]) for w in words)


def _hint(word: str, frags: tuple[str, ...]) -> int:
    """3 when ``word`` is a hint, 1 when it holds one (a two-letter hint only at its start: ``kvheads``), else 0."""
    if word in frags:
        return 3
    inside = any(f in word for f in frags if len(f) > 2) or any(word.startswith(f) for f in frags if len(f) == 2)
    return 1 if inside else 0


def _candidates(p: inspect.Parameter, taken: set[str]) -> list[str]:
    """The roles ``p`` may have, most likely first: by its annotation's type, then by the fragments of its name."""
    ann = _annotation(p)
    roles = list(INT_ROLES) if ann is int else ["dropout"] if ann is float else ["qkv_bias"] if ann is bool else \
        [*INT_ROLES, "dropout", "qkv_bias"] if ann is inspect.Parameter.empty else []
    roles += ["d_context"] if "d_in" in roles and _score(p, "d_context") else []
    roles += ["d_out"] if "d_in" in roles and _score(p, "d_out") else []
    roles += ["d_ff"] if "d_in" in roles and _score(p, "d_ff") else []
    return sorted((r for r in roles if r not in taken or r in SHARED_ROLES), key=lambda r: -_score(p, r))


def guess(p: inspect.Parameter, taken: set[str]) -> str | None:
    """The role ``p``'s name hints at (for an adapter, when no probe could run), or None."""
    best = _candidates(p, taken)[:1]
    return best[0] if best and _score(p, best[0]) > 0 else None


def weight_elements(spec: AttnSpec) -> int:
    """Elements of multi-head attention's weight matrices at ``spec``: queries, keys and values, output."""
    return spec.d_in * spec.d_out + 2 * spec.d_in * spec.kv_dim + spec.d_out * spec.d_out


def _fits(module: nn.Module, spec: AttnSpec, forward_only_x: bool) -> bool:
    """Whether ``module`` holds multi-head attention's weights at ``spec`` (and returns its shape): never when a
    parameter has no elements (a size set to 0 that hid a part, T2M-GPT's MLP of ``fc_rate * width``)."""
    if _matrices(module) != weight_elements(spec) or any(p.numel() == 0 for p in module.parameters()):
        return False
    if not forward_only_x:
        return True
    x = torch.randn(1, 5, spec.d_in)
    try:
        with torch.no_grad():
            out = module.float().eval()(x)
    except Exception:  # an image class fits too: its first build refuses it as such (plugins.forms)
        from attnbench.plugins.forms import image_form

        return image_form(module, spec.d_in) is not None
    out = out[0] if isinstance(out, tuple | list) else out  # GPT-2's old Attention returns [a, present]
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (1, 5, spec.d_out)


def fits_probes(build) -> bool:
    """Whether the class ``build`` makes holds multi-head attention's weights (and, for a ``forward(x)``, returns its
    shape) at both :data:`PROBES`."""
    only_x = _forward_only_x(build.target)
    try:
        return all(_fits(build(replace(s, num_kv_heads=None)), replace(s, num_kv_heads=None), only_x) for s in PROBES)
    except Exception:  # noqa: BLE001 - it does not build at the probes' sizes
        return False


def _fits_two_widths(build, only_x: bool) -> bool:
    """Whether the class ``build`` makes fits multi-head attention where the output width differs from the input's."""
    wide = replace(PROBES[0], num_kv_heads=None, d_out=PROBES[0].d_out + 8)
    try:
        return _fits(build(wide), wide, only_x)
    except Exception:  # noqa: BLE001 - does not build at two widths
        return False


def _forward_only_x(target) -> bool:
    forward = getattr(target, "forward", None)
    try:
        from attnbench.plugins.signatures import signature

        params = [p for p in list(signature(forward).parameters.values())[1:] if p.default is p.empty]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def solve(build_with, target, unknown: list[inspect.Parameter], taken: set[str]) -> tuple[Solved | None, list[str]]:
    """Roles for ``unknown`` (required constructor parameters no name binds): ``build_with(params)(spec)`` builds
    the class with ``params`` ((parameter, spec field) pairs) added. Returns the first assignment, in hint order,
    under which the class fits multi-head attention at both :data:`PROBES` (None when none does), and what each
    failed try raised (the first true cause, when nothing fits)."""
    options = [_candidates(p, taken) for p in unknown]
    only_x = _forward_only_x(target)
    errors: list[str] = []
    one_width, unfit = None, False
    shared = tuple(r for r in taken if r in SHARED_ROLES)
    allowed = (c for c in _by_hints(unknown, options)
               if not _repeats((*c, *shared)) and ("d_context" not in c or "d_in" in {*c, *taken}))
    for tries, combo in enumerate(itertools.islice(allowed, MAX_TRIES)):
        params = tuple(zip((p.name for p in unknown), combo, strict=True))
        label = ", ".join(f"{p}={f}" for p, f in params)
        if "num_kv_heads" not in combo and "num_kv_heads" not in taken:
            probes = tuple(replace(s, num_kv_heads=None) for s in PROBES)
        else:
            probes = PROBES
        try:
            built = [(build_with(params)(s), s) for s in probes]
        except Exception as exc:  # this assignment does not build: the next one may
            errors.append(f"{label}: {type(exc).__name__}: {_first(exc)}")
            continue
        if target not in BUILT or (whole_block(*BUILT[target]) is None and whole_block(*built[0]) is not None):
            BUILT[target] = built[0]  # the first that built, or the first that shows a whole block (a wide MLP)
        if not all(_fits(module, s, only_x) for module, s in built):
            extra = "" if unfit else _beyond_attention(*built[0])
            unfit = unfit or bool(extra)  # the first assignment that builds, holding what attention has not
            errors += [f"{label}: built, but {extra}"] if extra else []
        else:
            if "d_out" in {*combo, *taken} and not _fits_two_widths(build_with(params), only_x):
                one_width = one_width or (params, tries)  # the same function only where d_in == d_out
                continue
            return Solved(params, f"{', '.join(p for p, _ in params)}: roles decided by a probe: at two sizes the "
                                  "class builds and its weight matrices hold what multi-head attention of that size "
                                  f"holds; {tries} other assignment(s) tried first"), errors
    if one_width is not None:
        params, tries = one_width
        return Solved(params, f"{', '.join(p for p, _ in params)}: roles decided by a probe: the class holds what "
                              "multi-head attention holds only where its input and output widths are equal, so it is "
                              f"checked at one width; {tries} other assignment(s) tried first", one_width=True), errors
    return None, errors


def _beyond_attention(module, spec: AttnSpec) -> str:
    """What ``module`` holds beyond multi-head attention's weight matrices (a relative-position table, a memory): the
    matrices with a size no projection of ``spec`` has, when it holds more than attention does; its matrices when it
    holds fewer (projections shared by every head); ``""`` otherwise."""
    if not isinstance(module, nn.Module):
        return ""
    if 0 < _matrices(module) < weight_elements(spec):  # the 2017 tutorials' Linear(head_dim, head_dim) every head shares
        held = [f"{n} {tuple(p.shape)}" for n, p in module.named_parameters() if p.dim() >= 2]
        return (f"its weight matrices ({', '.join(held[:4])}) hold fewer weights than multi-head attention's "
                f"W_q, W_k, W_v, W_o {(spec.d_out, spec.d_in)} (projections every head shares?)")
    if _matrices(module) <= weight_elements(spec):
        return ""
    kv = spec.kv_dim
    sizes = {spec.d_in, spec.d_out, kv, 2 * kv, spec.d_out + 2 * kv, spec.head_dim, spec.num_heads, spec.kv_heads}
    extra = [f"{n} {tuple(p.shape)}" for n, p in module.named_parameters() if p.dim() >= 2 and set(p.shape) - sizes]
    return f"it holds {', '.join(extra[:3])}, which multi-head attention has no counterpart for" if extra else ""


MAX_COMBOS = 50_000
"""At most this many assignments are ranked by their hints (six unknown parameters of seven roles: 117,649)."""


def _by_hints(unknown: list[inspect.Parameter], options: list[list[str]]) -> list[tuple[str, ...]]:
    """Every assignment of ``options`` to ``unknown``, the ones whose names hint at their roles most first (ties in the
    order each parameter's own candidates come): FMS's ``(emb_dim, emb_kq, emb_v, nheads, kvheads)`` puts its heads
    and kv heads before any assignment that gives a head count to ``emb_kq``."""
    combos = list(itertools.islice(itertools.product(*options), MAX_COMBOS))
    return sorted(combos, key=lambda c: -sum(_score(p, r) for p, r in zip(unknown, c, strict=True)))


def unhinted_dropouts(build_with, params: tuple[tuple[str, str], ...], unknown, target) -> tuple[tuple, tuple, str]:
    """``(params, held, note)``: a float a probe made the dropout although its name says nothing of dropping (shap-e's
    ``init_scale``) stays the dropout only when, at 0.5, the class's train-mode output differs from its eval-mode
    one; otherwise it is held at 0.0, the value the probes built it with (``held``), and the class has no dropout."""
    kept, held = [], []
    by_name = {p.name: p for p in unknown}
    for name, role in params:
        if role == "dropout" and _score(by_name[name], "dropout") == 0 and not _drops(build_with(params), target):
            held.append((name, 0.0))
        else:
            kept.append((name, role))
    note = f"{', '.join(n for n, _ in held)}: 0.0, not the dropout (at 0.5 its train-mode output equals its eval-mode " \
           "one)" if held else ""
    return tuple(kept), tuple(held), note


def _drops(binding, target) -> bool:
    """Whether the class built with dropout 0.5 changes its output in train mode (True when a probe cannot tell)."""
    if not _forward_only_x(target):
        return True
    spec = replace(PROBES[0], num_kv_heads=None, dropout=0.5)
    x = torch.randn(1, 5, spec.d_in, generator=torch.Generator().manual_seed(46))
    try:
        module = binding(spec).float()
        with torch.no_grad():
            trained, evaluated = module.train()(x), module.eval()(x)
    except Exception:  # noqa: BLE001 - cannot tell: it stays the dropout
        return True
    trained = trained[0] if isinstance(trained, tuple) else trained
    evaluated = evaluated[0] if isinstance(evaluated, tuple) else evaluated
    return not torch.equal(trained, evaluated)


SHARED_ROLES = {"head_dim": 3}
"""Roles several parameters may take at once: the head size of the queries and keys and that of the values
(``MultiHeadAttention(d_model, n_heads, d_queries, d_values, ...)``, ``d_k``/``d_v``), one head dim in the spec; also
when one of them is bound by its name (FastSpeech2's ``d_k``; FMS's optional ``head_dim`` beside its ``emb_kq`` and
``emb_v``) and the others are not."""


def _repeats(combo: tuple[str, ...]) -> bool:
    """Whether ``combo`` gives a role to more parameters than it may take (:data:`SHARED_ROLES`, else one)."""
    return any(combo.count(r) > SHARED_ROLES.get(r, 1) for r in set(combo))


def _first(exc: BaseException) -> str:
    return first_line(exc)[:160]


def first_line(exc: BaseException) -> str:
    """The first line of what ``exc`` says; for a bare ``assert`` (no message), the failing line and its text."""
    text = str(exc).strip()
    if not text and exc.__traceback__ is not None:
        import linecache
        import traceback

        frame, line = list(traceback.walk_tb(exc.__traceback__))[-1]
        source = linecache.getline(frame.f_code.co_filename, line).strip()
        return f"at {frame.f_code.co_filename}:{line} {source!r}"[:200]
    return (text.splitlines()[0] if text else "")[:200]


def _matrices(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def whole_block(module, spec: AttnSpec) -> str | None:
    """Why ``module`` (built at ``spec``) is a transformer block rather than an attention layer: an attention submodule
    (a child whose name or class says attention, holding weights of its own) beside weight matrices of more than twice
    what attention of that size holds (an MLP); None otherwise."""
    if not isinstance(module, nn.Module):
        return None
    attn = next(((n, m) for n, m in module.named_children()
                 if any(w in f"{n} {type(m).__name__}".lower() for w in ("attention", "attn"))), None)
    matrices = _matrices(module)
    if attn is None or matrices <= 2 * weight_elements(spec) or not _matrices(attn[1]):
        return None  # no attention child that holds weights (sockeye's DotAttentionCell holds none: its parent is it)
    attn = (attn[0], type(attn[1]).__name__)
    return (f"its submodule {attn[0]} ({attn[1]}) is the attention, beside {matrices} weight-matrix elements where "
            f"attention of this size holds {weight_elements(spec)} (an MLP, norms and residuals around it)")
