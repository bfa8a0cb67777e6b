"""Hugging Face ``transformers`` attention layers, checked and timed by name (``hf:llama@sdpa``).

Names (resolved on demand by :func:`attnbench.registry.get` through the prefix this module registers; never among
the built-ins that default sweeps and a bare `check` run, and `transformers` is imported only when one is used):

* ``hf:gpt2``, ``hf:llama``, ``hf:mistral``, ``hf:qwen2``, ``hf:bert``: the model's own attention class
  (``GPT2Attention``, ``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``, ``BertSelfAttention``);
* ``hf:MODULE:CLASS`` for any other, e.g. ``hf:transformers.models.phi3.modeling_phi3:Phi3Attention``;
* each with ``@eager``, ``@sdpa`` (the default, as in ``transformers``), ``@flex_attention`` or
  ``@flash_attention_2`` (CUDA, with ``flash-attn`` installed): the ``attn_implementation``.

The layer is built from its model's own config class with the spec mapped onto that class's fields
(width, heads, kv heads, head_dim, max positions, attention dropout, the bias flag, the sliding window,
``is_decoder``; ``layer_idx=0`` in a one-layer config), and called as the model calls it: with the
causal, bidirectional or sliding-window mask that ``transformers.masking_utils`` makes for the
backend, and the ``position_embeddings`` of the model's own rotary class (``LlamaRotaryEmbedding``, ...) built
from the spec's ``rope_theta`` and ``rope_scaling`` (Llama-3 scaling as ``rope_type="llama3"``) at the absolute
positions of the call; a spec without RoPE gets a neutral embedding (cos = 1, sin = 0). The rotary classes
compute their tables in float32 whatever the layer's dtype, and Llama-style eager paths take their softmax in float32:
the float64 cases run, judged at that working precision (:mod:`attnbench.correctness.precision`).
The first element of its output is the result. What the layer supports (GQA, sliding windows, non-causal
attention, dropout, a KV cache) is read from the config class's fields and the layer's signature.

Canonical weights map onto ``q_proj/k_proj/v_proj/o_proj`` style ``nn.Linear`` layers or GPT-2's fused
``Conv1D`` (stored (in, out)); a bias the model always has but the spec has not is held at zero and
frozen; a bias the model lacks is held at zero in the reference. A layer without an output projection
(BERT's self-attention: the output dense sits in ``BertSelfOutput`` with the residual and LayerNorm)
gets one ``nn.Linear`` here, the counterpart of ``BertSelfOutput.dense``.

Decoding (``--mode decode``) goes through the model's own cache: ``DynamicCache(config=...)`` passed
as ``past_key_values`` (``cache`` in newer releases), rewound with ``crop``. A sliding-window layer's
cache records its past (``activate_past_recording``) so that ``crop`` can rewind past the window, and
after each call keeps the last ``window`` tokens (one more than ``transformers`` keeps: the one a
rewind needs).

``transformers`` is an optional extra (``pip install 'attnbench[hf]'``); without it these names are
listed as unavailable with that command.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect

import torch
from torch import nn

from attnbench.errors import InputShapeError, InvalidSpecError, PluginLoadError, UnavailableError, UnknownImplementationError
from attnbench.plugins import signatures
from attnbench.plugins.binding import ALIASES, RESIDUAL_DROPOUT
from attnbench.plugins.catalog import Implementation, register_prefix
from attnbench.spec import AttnSpec
from attnbench.weights import Adapter, CanonicalWeights

PREFIX = "hf:"
INSTALL = "pip install 'attnbench[hf]'"
MODELS = {
    "gpt2": "transformers.models.gpt2.modeling_gpt2:GPT2Attention",
    "llama": "transformers.models.llama.modeling_llama:LlamaAttention",
    "mistral": "transformers.models.mistral.modeling_mistral:MistralAttention",
    "qwen2": "transformers.models.qwen2.modeling_qwen2:Qwen2Attention",
    "bert": "transformers.models.bert.modeling_bert:BertSelfAttention",
}
"""Short names -> the attention class of that model."""
BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2")
DEFAULT_BACKEND = "sdpa"  # transformers' own default when torch has SDPA

# Projection names, in the order they are looked for (the first present wins).
_Q, _K, _V = ("q_proj", "query", "q", "wq"), ("k_proj", "key", "k", "wk"), ("v_proj", "value", "v", "wv")
_O = ("o_proj", "out_proj", "dense", "wo", "o")


def transformers_missing() -> str | None:
    """Why ``hf:`` names cannot run here (``transformers`` not installed, with the install command), or None."""
    if importlib.util.find_spec("transformers") is None:
        return f"transformers is not installed; {INSTALL}"
    return None


def names() -> list[str]:
    """The ``hf:`` names of the shipped short names, every backend (what ``attnbench list`` shows)."""
    return [f"{PREFIX}{model}@{backend}" for model in MODELS for backend in BACKENDS]


# ---------------------------------------------------------------- resolving a name


def parse(name: str) -> tuple[str, str, str]:
    """``hf:llama@eager`` -> ``("transformers.models.llama.modeling_llama", "LlamaAttention", "eager")``."""
    rest = name[len(PREFIX):]
    target, _, backend = rest.rpartition("@") if "@" in rest else (rest, "", DEFAULT_BACKEND)
    if backend not in BACKENDS:
        raise UnknownImplementationError(f"unknown attention backend {backend!r} in {name!r}; use one of "
                                         f"{', '.join('@' + b for b in BACKENDS)}")
    target = MODELS.get(target, target)
    module_path, _, cls_name = target.rpartition(":")
    if not module_path or not cls_name:
        raise UnknownImplementationError(f"{name!r} is not hf:MODEL[@BACKEND] (MODEL one of {', '.join(MODELS)}) "
                                         "or hf:package.module:Class[@BACKEND]")
    return module_path, cls_name, backend


def implementation(name: str):
    """The :class:`~attnbench.registry.Implementation` called ``name`` (``hf:...``), capabilities from the config class."""
    module_path, cls_name, backend = parse(name)
    source = f"transformers {module_path}:{cls_name}, attn_implementation={backend!r}"
    missing = transformers_missing()
    if missing is not None:  # capabilities unknown until installed: let the install command be the reason shown
        return Implementation(name=name, factory=_raiser(missing), description=f"{cls_name} ({backend}): {missing}",
                              source=source, same_width_only=True, gqa=True, sliding_window=True, non_causal=True,
                              kv_cache=True, probe=lambda _device, r=missing: r, origin="hf")
    layer_cls, config_cls = _classes(module_path, cls_name)
    caps = capabilities(layer_cls, config_cls, backend)
    import transformers

    return Implementation(
        name=name, factory=functools.partial(HFAttention, layer_cls=layer_cls, config_cls=config_cls, backend=backend),
        description=f"Hugging Face {cls_name} with attn_implementation={backend!r}"
                    + (" (its own rotary embedding)" if caps.get("rope") else ""),
        source=f"{source} (transformers {transformers.__version__}); docs/hugging-face.md",
        probe=functools.partial(_backend_reason, backend), origin="hf", **caps)


def _raiser(message: str):
    def factory(spec: AttnSpec) -> nn.Module:
        raise UnavailableError(message)

    return factory


@functools.lru_cache(maxsize=64)
def _classes(module_path: str, cls_name: str) -> tuple[type, type]:
    """The attention class and its model's config class (from the ``config`` annotation, else the module's
    ``PreTrainedModel.config_class``, else the one config class the module imports)."""
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as exc:
        raise PluginLoadError(f"module {module_path!r} not found ({exc}); check the name, or {INSTALL}") from exc
    layer_cls = getattr(module, cls_name, None)
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, nn.Module)):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and n.endswith("Attention"))
        raise PluginLoadError(f"{module_path} has no nn.Module {cls_name!r}; its attention classes: {', '.join(found) or 'none'}")
    import transformers
    from transformers import PreTrainedModel

    PretrainedConfig = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig  # v5 / v4 name

    def is_config(obj) -> bool:
        return isinstance(obj, type) and issubclass(obj, PretrainedConfig) and obj is not PretrainedConfig

    hint = signatures.signature(layer_cls.__init__).parameters.get("config")
    annotation = getattr(hint, "annotation", None)
    if isinstance(annotation, str):
        annotation = getattr(module, annotation, None)
    if is_config(annotation):
        return layer_cls, annotation
    models = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, PreTrainedModel)
              and is_config(getattr(v, "config_class", None))]
    configs = {m.config_class for m in models} or {v for v in vars(module).values() if is_config(v)}
    if len(configs) != 1:
        raise PluginLoadError(f"cannot tell which config class builds {cls_name} in {module_path} "
                              f"(found {sorted(c.__name__ for c in configs) or 'none'})")
    return layer_cls, configs.pop()


def _config_fields(config_cls: type) -> set[str]:
    """Fields the config class's constructor takes by name (and the names its ``attribute_map`` forwards)."""
    params = set(signatures.signature(config_cls).parameters)
    return params | set(getattr(config_cls, "attribute_map", {}) or {})


def _first(fields: set[str], candidates) -> str | None:
    return next((c for c in candidates if c in fields), None)


def _forward_params(layer_cls: type) -> set[str]:
    return set(signatures.signature(layer_cls.forward).parameters)


def capabilities(layer_cls: type, config_cls: type, backend: str) -> dict:
    """What the layer computes and where, from its config class's fields and its own signature."""
    fields = _config_fields(config_cls)
    has_dropout = _first(fields, ALIASES["dropout"]) is not None
    cached = bool({"cache", "past_key_values"} & _forward_params(layer_cls))
    rotary = "position_embeddings" in _forward_params(layer_cls) and rotary_class(layer_cls) is not None
    caps = dict(same_width_only=True,  # the layer maps hidden_size to hidden_size
                rope=("half",) if rotary and _rope_fields(fields) else (),
                gqa=_first(fields, ALIASES["num_kv_heads"]) is not None,
                sliding_window="sliding_window" in fields,
                non_causal="is_decoder" in fields,  # encoders (BERT) are causal only as decoders
                kv_cache=cached)
    if backend == "flash_attention_2":
        caps.update(devices=("cuda",), dtypes=("float16", "bfloat16"), backward=("cuda",),
                    dropout=("cuda",) if has_dropout else ())
    elif backend == "flex_attention":  # transformers compiles flex_attention; it has no dropout
        caps.update(backward=("cuda",), dropout=(), min_torch="2.5")
    else:
        caps.update(dropout=("cpu", "cuda") if has_dropout else ())
    return caps


def rotary_class(layer_cls: type) -> type | None:
    """The model's own rotary-embedding class (``LlamaRotaryEmbedding``: built from the config, called with
    ``(x, position_ids)``), from the layer's module; None when it has none."""
    module = inspect.getmodule(layer_cls)
    found = [v for n, v in vars(module).items() if n.endswith("RotaryEmbedding") and isinstance(v, type)
             and issubclass(v, nn.Module) and "config" in signatures.signature(v.__init__).parameters]
    return found[0] if len(found) == 1 else None


def _rope_fields(fields: set[str]) -> str | None:
    """How the config class takes RoPE: ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x); None: not at all."""
    return _first(fields, ("rope_parameters", "rope_theta"))


def rope_config(fields: set[str], spec: AttnSpec) -> dict:
    """The config fields for ``spec``'s RoPE (theta, Llama-3 scaling as ``rope_type="llama3"``)."""
    theta, scaling = getattr(spec, "rope_theta", None), getattr(spec, "rope_scaling", None)
    if theta is None:
        return {}
    params = {"rope_type": "default", "rope_theta": float(theta)}
    if scaling is not None:
        params.update(rope_type="llama3", factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
                      high_freq_factor=scaling.high_freq_factor,
                      original_max_position_embeddings=scaling.original_context_length)
    if _rope_fields(fields) == "rope_parameters":
        return {"rope_parameters": params}
    legacy = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": float(theta), "rope_scaling": legacy if scaling is not None else None}


def _backend_reason(backend: str, device: torch.device | None) -> str | None:
    """Why ``backend`` cannot run here (a kernel package or torch feature missing), or None."""
    from transformers import utils

    if backend == "flash_attention_2" and not utils.is_flash_attn_2_available():
        return "flash_attention_2 needs the flash-attn package and CUDA (pip install flash-attn)"
    if backend == "flex_attention" and not utils.is_torch_flex_attn_available():
        return "flex_attention is not in this torch build"
    return None


# ---------------------------------------------------------------- the layer


def make_config(config_cls: type, spec: AttnSpec, backend: str):
    """``config_cls`` for one attention layer of ``spec`` (layer 0 of a one-layer model), set to ``backend``."""
    fields = _config_fields(config_cls)
    values = {"d_in": spec.d_in, "num_heads": spec.num_heads, "num_kv_heads": spec.kv_heads,
              "context_length": spec.context_length, "dropout": float(spec.dropout), "qkv_bias": spec.qkv_bias,
              "head_dim": spec.head_dim}
    kwargs = {}
    for field, value in values.items():
        key = _first(fields, ALIASES[field])
        if key is not None:
            kwargs[key] = value
    kwargs.update({name: 0.0 for name in RESIDUAL_DROPOUT if name in fields})  # only attention's dropout is the spec's
    if "num_hidden_layers" in fields or "n_layer" in fields:
        kwargs[_first(fields, ("num_hidden_layers", "n_layer"))] = 1
    if "sliding_window" in fields:
        kwargs["sliding_window"] = spec.window
    if "use_sliding_window" in fields:
        kwargs["use_sliding_window"] = spec.window is not None
    if "layer_types" in fields:  # Qwen2-style hybrids: layer 0 is a sliding layer exactly when the spec has a window
        kwargs["layer_types"] = ["sliding_attention" if spec.window is not None else "full_attention"]
    if "is_decoder" in fields:
        kwargs["is_decoder"] = spec.causal
    kwargs.update(rope_config(fields, spec))
    try:
        config = config_cls(**kwargs)
    except Exception as exc:
        raise PluginLoadError(f"{config_cls.__name__}({kwargs}) failed: {type(exc).__name__}: {exc}") from exc
    config._attn_implementation = backend
    return config


class HFAttention(nn.Module):
    """One Hugging Face attention layer called as its model calls it, with attnbench's input/output contract."""

    def __init__(self, spec: AttnSpec, layer_cls: type, config_cls: type, backend: str) -> None:
        super().__init__()
        if spec.window is not None and not spec.causal:  # masking_utils counts |i - j| <= w there, not < w
            raise UnavailableError("a bidirectional sliding window is not mapped onto transformers' masks")
        self.spec, self.backend = spec, backend
        self.config = make_config(config_cls, spec, backend)
        self.layer = _construct(layer_cls, self.config, spec)
        params = _forward_params(layer_cls)
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._cache_position = "cache_position" in params  # transformers 4.x layers take it explicitly
        self._rope = "position_embeddings" in params
        rotary = rotary_class(layer_cls) if getattr(spec, "rope_theta", None) is not None else None
        self.rotary = rotary(config=self.config) if rotary is not None else None  # the model's own tables
        self.sliding = self._is_sliding()
        self.out_proj = None
        if _find(self.layer, _O) is None and _fused(self.layer) is None:  # BERT: the output dense is outside the layer
            self.out_proj = nn.Linear(spec.d_out, spec.d_out)
        self.weight_adapter = _adapter(self)
        self.cache = None
        self.reset_cache()

    def _is_sliding(self) -> bool:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[0] == "sliding_attention"
        return getattr(self.config, "sliding_window", None) is not None

    # -- masks and rotary embeddings, as the model makes them ------------------------------------------
    def _mask(self, x: torch.Tensor, cache, position_ids: torch.Tensor):
        from transformers import masking_utils as mu

        if not self.spec.causal:
            fn = mu.create_bidirectional_mask
        elif self.sliding:
            fn = mu.create_sliding_window_causal_mask
        else:
            fn = mu.create_causal_mask
        given = {"config": self.config, "inputs_embeds": x, "input_embeds": x, "attention_mask": None,
                 "cache": cache, "past_key_values": cache, "position_ids": position_ids,
                 "cache_position": position_ids[0]}
        return fn(**{k: v for k, v in given.items() if k in _params_of(fn)})

    def forward(self, x: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        if use_cache:
            self._check_cached(x)
        else:
            self.spec.check_input(x)
        # The model hands its layers a LayerNorm output, always contiguous; GPT-2's Conv1D (x.view) refuses
        # anything else. A no-op for contiguous x, so timings are unaffected.
        x = x.contiguous()
        t = x.shape[1]
        cache = self.cache if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(past, past + t, device=x.device)[None]  # (1, t)
        kwargs = {"attention_mask": self._mask(x, cache, position_ids)}
        if self.rotary is not None:  # the model's own rotary embedding at the absolute positions
            kwargs["position_embeddings"] = self.rotary(x, position_ids)
        elif self._rope:  # neutral rotary embedding: q * 1 + rotate_half(q) * 0 == q
            cos = torch.ones(1, t, self.spec.head_dim, dtype=x.dtype, device=x.device)  # (1, t, hd)
            kwargs["position_embeddings"] = (cos, torch.zeros_like(cos))
        if cache is not None:
            kwargs[self._cache_arg] = cache
            if self._cache_position:
                kwargs["cache_position"] = position_ids[0]
        out = self.layer(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out  # (b, t, d_out)
        if cache is not None:
            self._keep_window()
        return self.out_proj(out) if self.out_proj is not None else out

    # -- the KV-cache protocol (implementations/kv_cache.py), through transformers' own cache ----------
    def _check_cached(self, x: torch.Tensor) -> None:
        if not self.spec.causal:
            raise InvalidSpecError("use_cache=True needs causal attention: build the layer with causal=True")
        if x.dim() != 3 or x.shape[-1] != self.spec.d_in:
            self.spec.check_input(x)
        held = self.cache.get_seq_length()
        if held + x.shape[1] > self.spec.context_length:
            raise InputShapeError(f"the KV cache would hold {held + x.shape[1]} tokens, more than context_length="
                                  f"{self.spec.context_length}; call reset_cache() or build the layer with a larger "
                                  "context_length")

    def reset_cache(self) -> None:
        """A fresh ``DynamicCache`` for this config (sliding layers record their past so ``crop`` can rewind)."""
        if transformers_missing() is not None:
            return
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.config) if "config" in _params_of(DynamicCache) else DynamicCache()
        if hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()

    def _sliding_layers(self):
        return [layer for layer in getattr(self.cache, "layers", []) if getattr(layer, "is_sliding", False)
                and getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", True)]

    def _keep_window(self) -> None:
        # A recording sliding layer keeps every token until crop(); keep the `window` that a rewind of one
        # token and the next call need (transformers itself keeps window - 1), as a copy so the rest is freed.
        for layer in self._sliding_layers():
            w = layer.sliding_window
            if layer.keys.shape[-2] > w:
                layer.keys, layer.values = layer.keys[..., -w:, :].clone(), layer.values[..., -w:, :].clone()

    def rewind_cache(self, n: int = 1) -> None:
        """Forget the last ``n`` tokens (``cache.crop(-n)``)."""
        for layer in self._sliding_layers():
            beyond = layer.get_seq_length() >= layer.sliding_window
            if beyond and layer.keys.shape[-2] - n < layer.sliding_window - 1:
                raise ValueError(f"a sliding-window cache past its window rewinds at most "
                                 f"{layer.keys.shape[-2] - layer.sliding_window + 1} token(s) here (asked {n})")
        self.cache.crop(-n)

    def cache_tensors(self) -> list[torch.Tensor]:
        """The keys and values the cache holds."""
        out = []
        for layer in getattr(self.cache, "layers", []):
            out += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                    if isinstance(t, torch.Tensor) and t.numel()]
        return out


@functools.lru_cache(maxsize=256)
def _params_cached(fn) -> frozenset[str]:
    return frozenset(signatures.signature(fn).parameters)


def _params_of(fn) -> frozenset[str]:
    return _params_cached(fn)


def _construct(layer_cls: type, config, spec: AttnSpec) -> nn.Module:
    """``layer_cls(config, layer_idx=0)``, with ``is_causal`` where the class takes it (BERT)."""
    params = signatures.signature(layer_cls.__init__).parameters
    kwargs = {}
    if "layer_idx" in params:
        kwargs["layer_idx"] = 0
    if "is_causal" in params:
        kwargs["is_causal"] = spec.causal
    required = [n for n, p in list(params.items())[2:] if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in kwargs]
    if required:
        raise PluginLoadError(f"{layer_cls.__name__}(config, ...) also needs {', '.join(required)}, which attnbench "
                              "does not know how to fill")
    return layer_cls(config, **kwargs)


# ---------------------------------------------------------------- canonical weights


def _find(layer: nn.Module, names) -> str | None:
    return next((n for n in names if isinstance(getattr(layer, n, None), nn.Linear)), None)


def _fused(layer: nn.Module) -> str | None:
    """The name of a GPT-2 style fused ``Conv1D`` q/k/v projection (``c_attn``), or None."""
    from transformers.pytorch_utils import Conv1D

    return "c_attn" if isinstance(getattr(layer, "c_attn", None), Conv1D) else None


def _adapter(module: HFAttention) -> Adapter:
    """How the canonical weights map onto ``module.layer`` (and its own ``out_proj``, when it has one)."""
    layer, spec = module.layer, module.spec
    frozen: list[nn.Parameter] = []  # biases the model always has and the spec lacks: held at zero, frozen

    def freeze(p: nn.Parameter | None) -> None:
        if p is not None and not spec.qkv_bias:
            with torch.no_grad():
                p.zero_()
            p.requires_grad_(False)
            frozen.append(p)

    if _fused(layer):
        return _fused_adapter(layer, freeze, frozen)
    return _split_adapter(module, freeze, frozen)


def _fused_adapter(layer: nn.Module, freeze, frozen: list) -> Adapter:
    """GPT-2: ``c_attn`` (d_in, 3 d_out) and ``c_proj`` (d_out, d_out), ``Conv1D`` stored (in, out)."""
    from transformers.pytorch_utils import Conv1D

    if not isinstance(getattr(layer, "c_proj", None), Conv1D):
        raise PluginLoadError(f"{type(layer).__name__} has c_attn but no Conv1D c_proj")
    freeze(layer.c_attn.bias)
    qkv_bias = not frozen

    def to_state(w: CanonicalWeights, s: AttnSpec) -> dict[str, torch.Tensor]:
        state = {"layer.c_attn.weight": torch.cat([w.W_q, w.W_k, w.W_v]).t(), "layer.c_proj.weight": w.W_o.t(),
                 "layer.c_proj.bias": w.b_o}
        if qkv_bias:
            state["layer.c_attn.bias"] = torch.cat([w.b_q, w.b_k, w.b_v])
        return state

    def from_state(st, s: AttnSpec) -> CanonicalWeights:
        W_q, W_k, W_v = st["layer.c_attn.weight"].t().split([s.d_out, s.kv_dim, s.kv_dim])
        b = st["layer.c_attn.bias"].split([s.d_out, s.kv_dim, s.kv_dim]) if s.qkv_bias else (None,) * 3
        return CanonicalWeights(W_q=W_q, W_k=W_k, W_v=W_v, b_q=b[0], b_k=b[1], b_v=b[2],
                                W_o=st["layer.c_proj.weight"].t(), b_o=st["layer.c_proj.bias"])

    return Adapter(to_state, from_state)


def _split_adapter(module: HFAttention, freeze, frozen: list) -> Adapter:
    """Separate ``q_proj/k_proj/v_proj/o_proj`` style ``nn.Linear`` layers (or ``module.out_proj`` for a layer without
    an output projection); biases the model lacks are held at zero in the reference."""
    layer, spec = module.layer, module.spec
    names = [_find(layer, c) for c in (_Q, _K, _V)]
    if None in names:
        children = ", ".join(n for n, _ in layer.named_children()) or "none"
        raise PluginLoadError(f"{type(layer).__name__}: no q/k/v nn.Linear projections found (children: {children}); "
                              "hf: names support q_proj/k_proj/v_proj/o_proj, query/key/value and GPT-2's c_attn/c_proj")
    q, k, v = (f"layer.{n}" for n in names)
    o_name = _find(layer, _O)
    o = f"layer.{o_name}" if o_name else "out_proj"
    o_linear = getattr(layer, o_name) if o_name else module.out_proj
    for n in names:
        freeze(getattr(layer, n).bias)
    has_qkv_bias = getattr(layer, names[0]).bias is not None and not frozen
    has_o_bias = o_linear.bias is not None
    held = {"b_q", "b_k", "b_v"} if spec.qkv_bias and not has_qkv_bias else set()  # Mistral: no biases at all
    if not has_o_bias:  # Llama without attention_bias, Mistral, Qwen2
        held.add("b_o")

    def to_state(w: CanonicalWeights, s: AttnSpec) -> dict[str, torch.Tensor]:
        state = {f"{q}.weight": w.W_q, f"{k}.weight": w.W_k, f"{v}.weight": w.W_v, f"{o}.weight": w.W_o}
        if has_qkv_bias:
            state.update({f"{q}.bias": w.b_q, f"{k}.bias": w.b_k, f"{v}.bias": w.b_v})
        if has_o_bias:
            state[f"{o}.bias"] = w.b_o
        return state

    def from_state(st, s: AttnSpec) -> CanonicalWeights:
        like = st[f"{o}.weight"]
        zeros = {"b_q": s.d_out, "b_k": s.kv_dim, "b_v": s.kv_dim}

        def bias(name: str, key: str):
            if not s.qkv_bias:
                return None
            return st[key] if has_qkv_bias else like.new_zeros(zeros[name])

        return CanonicalWeights(W_q=st[f"{q}.weight"], W_k=st[f"{k}.weight"], W_v=st[f"{v}.weight"],
                                b_q=bias("b_q", f"{q}.bias"), b_k=bias("b_k", f"{k}.bias"), b_v=bias("b_v", f"{v}.bias"),
                                W_o=like, b_o=st[f"{o}.bias"] if has_o_bias else like.new_zeros(s.d_out))

    return Adapter(to_state, from_state, frozenset(held))


register_prefix("hf:", implementation, names)  # hf: names resolve through the registry, on demand
