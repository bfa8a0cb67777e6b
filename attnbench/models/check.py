"""Correctness at block and model scope (``attnbench check --scope block|model``), on tiny models.

* ``block`` / ``model``: the block's output and the model's logits match a float64 reference block and model with
  the same weights (the reference attention, :mod:`attnbench.correctness.reference`, in every block; the surroundings
  the implementation's, rounded as it sees them);
* ``generate`` (model scope): greedy generation with the KV cache produces the same tokens as without it, and both
  the same as the float64 reference model, for :data:`NEW_TOKENS` steps; the cached and uncached logits agree at
  every step. A failure names the first differing step and token.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd
import torch

from attnbench import registry
from attnbench.correctness.cases import TOLERANCE, CaseResult, build, rel_error
from attnbench.devices import DTYPES, parse_device
from attnbench.models.generate import first_divergence, first_logit_gap, generate
from attnbench.models.zoo import ModelShape, ReferenceAttention, assemble, layer_weights
from attnbench.resolve import Skip, resolve

TINY = ModelShape(d_model=16, num_heads=2, layers=2, vocab=48, context=40)
"""The model every scope check uses (the block is one of its blocks)."""
TINY_GQA = ModelShape(d_model=16, num_heads=4, layers=2, vocab=48, context=40, num_kv_heads=2)
"""Its grouped-query variant (Llama-style blocks), for implementations that declare GQA."""
BATCH, SEQ, PROMPT, NEW_TOKENS = 2, 9, 5, 24
SCOPE_TOLERANCE = {k: 10 * v for k, v in TOLERANCE.items()}
"""A block or model stacks norms, MLPs and layers on the attention: ten times the layer's tolerance."""
SCOPE_KINDS = {"block": ("block",), "model": ("model", "generate")}


def pair(impl, shape: ModelShape, scope: str, device, dtype: str, seed: int = 0):
    """The implementation's block or model in ``dtype`` and the float64 reference with the same weights."""
    one = shape if scope == "model" else ModelShape(shape.d_model, shape.num_heads, 1, 0, shape.context,
                                                    shape.num_kv_heads)
    refs = []

    def make_attn(i):
        built = build(impl, one.spec, device, dtype, layer_weights(one, i, seed))
        refs.append(ReferenceAttention(built.weights, one.spec))
        return built.module.eval()

    model = assemble(one, seed, make_attn, device, DTYPES[dtype]).eval()
    reference = assemble(one, seed, lambda i: refs[i], "cpu", torch.float64).eval()
    theirs = dict(model.named_parameters())
    with torch.no_grad():  # the surroundings as the implementation's model has them (rounded to its dtype)
        for name, p in reference.named_parameters():
            if ".attn." not in f".{name}" and name in theirs:
                p.copy_(theirs[name].detach().cpu().to(torch.float64))
    return model, reference


def _result(impl, kind, shape_id, dtype, device, status, err=None, tol=None, message=""):
    return CaseResult(impl.name, kind, shape_id, dtype, str(device), status, err, tol, message)


def check_output(impl, scope: str, shape: ModelShape, device, dtype: str, seed: int = 0) -> CaseResult:
    """The block's output or the model's logits against the float64 reference (relative max-norm error)."""
    model, reference = pair(impl, shape, scope, device, dtype, seed)
    g = torch.Generator().manual_seed(seed + 7)
    if scope == "model":
        x = torch.randint(0, shape.vocab, (BATCH, SEQ), generator=g)
        x_ref, x_in = x, x.to(device)
    else:
        x_ref = torch.randn(BATCH, SEQ, shape.d_model, generator=g, dtype=torch.float64).to(DTYPES[dtype]).double()
        x_in = x_ref.to(device=device, dtype=DTYPES[dtype])
    with torch.inference_mode():
        err = rel_error(model(x_in).cpu(), reference(x_ref))
    tol = SCOPE_TOLERANCE[dtype]
    ok = err <= tol
    return _result(impl, scope, _shape_id(shape), dtype, device, "pass" if ok else "fail", err, tol,
                   "" if ok else f"{scope} output error {err:.3g} > tolerance {tol:.1g}")


def check_generation(impl, shape: ModelShape, device, dtype: str, seed: int = 0,
                     new_tokens: int = NEW_TOKENS) -> CaseResult:
    """Cache-on tokens == cache-off tokens == the float64 reference's, and equal logits cached and uncached."""
    model, reference = pair(impl, shape, "model", device, dtype, seed)
    prompt = torch.randint(0, shape.vocab, (BATCH, PROMPT), generator=torch.Generator().manual_seed(seed + 11))
    ref = generate(reference, prompt, new_tokens, use_cache=False)
    off = generate(model, prompt.to(device), new_tokens, use_cache=False, keep_logits=True)
    runs = [("the float64 reference", ref.tokens, "without the cache", off.tokens)]
    problems = []
    on = None
    if impl.kv_cache:
        on = generate(model, prompt.to(device), new_tokens, use_cache=True, keep_logits=True)
        runs.insert(0, ("without the cache", off.tokens, "with the cache", on.tokens))
    for name_a, a, name_b, b in runs:
        d = first_divergence(a, b, PROMPT)
        if d is not None:
            problems.append(d.text(name_a, name_b))
    tol = SCOPE_TOLERANCE[dtype]
    gap = first_logit_gap(on.logits, off.logits, tol) if on is not None else None
    if gap is not None:
        problems.append(f"logits with the cache differ from without it from step {gap[0]} (error {gap[1]:.3g} > {tol:.1g})")
    return _result(impl, "generate", _shape_id(shape), dtype, device, "fail" if problems else "pass",
                   None if gap is None else gap[1], tol, "; ".join(problems) if problems else "")


def _shape_id(shape: ModelShape) -> str:
    return f"{'gqa_' if shape.llama else ''}d{shape.d_model}h{shape.num_heads}L{shape.layers}V{shape.vocab}"


def run_scope_checks(impls: Iterable[str] | None, scope: str, device: str = "cpu", seed: int = 0,
                     dtypes=("float64", "float32")) -> pd.DataFrame:
    """Every ``scope`` check of every implementation (default: all available on ``device``), as the matrix's rows."""
    dev = parse_device(device)
    names = list(impls) if impls else [n for n in registry.names() if not registry.get(n).unavailable_reason(device)]
    rows = []
    for name in names:
        impl = registry.get(name)
        for shape in (TINY, TINY_GQA):
            for dtype in dtypes:
                for kind in SCOPE_KINDS[scope]:
                    rows.append(_one(impl, kind, scope, shape, dev, dtype, seed))
    return pd.DataFrame([r.__dict__ for r in rows])


def _one(impl, kind, scope, shape, dev, dtype, seed) -> CaseResult:
    mode = "decode" if kind == "generate" and impl.kv_cache else "inference"
    outcome = resolve(impl, shape.spec, device=str(dev), dtype=dtype, mode=mode, batch=BATCH, seq_len=SEQ)
    if isinstance(outcome, Skip):
        return _result(impl, kind, _shape_id(shape), dtype, dev, "skip", message=outcome.reason)
    try:
        if kind == "generate":
            return check_generation(impl, shape, dev, dtype, seed)
        return check_output(impl, scope, shape, dev, dtype, seed)
    except Exception as exc:  # the implementation raised inside the block or model: an error row with its message
        return _result(impl, kind, _shape_id(shape), dtype, dev, "error", message=f"{type(exc).__name__}: {exc}"[:300])

