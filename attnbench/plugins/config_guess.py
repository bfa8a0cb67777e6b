"""A config field no spec field fills, given the value its class's source says it takes.

metavoice's ``SelfAttention(config)`` reads ``config.attn_kernel_type`` and later runs
``if self.attn_kernel_type == "torch_attn": ... else: raise``; LoRA's GPT-2 ``Attention(nx, n_ctx, config, scale)``
reads ``config.lora_attn_dim``, ``lora_attn_alpha`` and ``lora_dropout``, where 0 is no adapter. attnbench's
:class:`~attnbench.plugins.binding.SpecConfig` carries every alias of every spec field; a field it does not carry gets

- the first string its module compares it with (``== "torch_attn"``, ``in ("torch", "sdpa")``), directly or through
  the attribute it is stored in (``self.attn_kernel_type = config.attn_kernel_type``), preferring one that names no
  kernel or variant (``flash``, ``xformers``, ``sliding``...);
- ``None`` when its module tests it against None (``if cfg.qk_norm_config is not None:``): the part is absent;
- else ``0`` (``False`` as a switch: nothing added, nothing turned on), which read as a sub-config
  (``config.model.n_embd``) is the config itself (:class:`GuessedInt`).

Every guess is printed by ``check -v`` beside the constructor, and the correctness matrix decides: a class a guess
changes into another function fails its cases with the guess named. A field that is read but must be something else
(a tuple, a module) raises where it is used, and that construction failure is the refusal's first cause.
"""

from __future__ import annotations

import inspect
import re
import sys

ADDON_WORDS = ("lora", "adapter", "adapters", "prompt", "ia3", "peft", "dora")
"""First words of config fields that size a parameter-efficient add-on (LoRA's ``lora_attn_dim``, its rank): never read
as the spec field their tail names, nor given a role; guessed 0, the add-on off."""
GUESSED: dict = {}
"""Constructor -> {field: (value, why)} of the fields guessed while it was built, for ``check -v``."""
KERNEL_WORDS = ("flash", "fa2", "fa3", "xformers", "triton", "cuda", "fused", "apex", "sliding", "local", "sparse",
                "linear", "window", "cross", "mem_eff", "npu", "tpu", "ring")
"""Words that name a kernel or a variant in a literal: the plain choice is another (``torch_attn``, ``sdpa``, ``eager``)."""


def _source(target) -> str:
    try:
        module = sys.modules.get(getattr(target, "__module__", ""), None)
        return inspect.getsource(module) if module is not None else inspect.getsource(target)
    except (OSError, TypeError):
        return ""


def compared_literals(target, name: str) -> list[str]:
    """The strings the source of ``target``'s module compares field ``name`` with, in source order."""
    text = _source(target)
    if not text:
        return []
    stored = set(re.findall(rf"self\.(\w+)\s*=\s*\w+\.{re.escape(name)}\b", text))
    names = "|".join(re.escape(n) for n in {name, *stored})
    found: list[tuple[int, str]] = []
    for m in re.finditer(rf"\.(?:{names})\b\s*(?:==|!=)\s*(['\"])([^'\"\n]+)\1", text):
        found.append((m.start(), m.group(2)))
    for m in re.finditer(rf"(['\"])([^'\"\n]+)\1\s*(?:==|!=)\s*[\w.]*\.(?:{names})\b", text):
        found.append((m.start(), m.group(2)))
    for m in re.finditer(rf"\.(?:{names})\b\s+in\s*[(\[{{]([^)\]}}\n]*)[)\]}}]", text):
        found += [(m.start() + i, s) for i, (_, s) in enumerate(re.findall(r"(['\"])([^'\"\n]+)\1", m.group(1)))]
    return list(dict.fromkeys(s for _, s in sorted(found)))


class GuessedInt(int):
    """A guessed int that is also the config it was read from: ``config.model.n_embd`` (a sub-config attnbench does not
    carry) reads ``n_embd`` of the config itself, while ``config.lora_dim`` is 0 in every arithmetic and test."""

    def __new__(cls, config, value: int = 0):
        obj = super().__new__(cls, value)
        obj._config = config
        return obj

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._config, name)

    def __getitem__(self, name):
        return self._config[name]

    def __iter__(self):  # a list field (modalities' ``attention_config.qkv_transforms``): none, as 0 is none
        return iter(())

    def __repr__(self) -> str:
        return str(int(self))

    def __reduce__(self):  # a copied module (deepcopy, pickle) keeps the plain int
        return int, (int(self),)


def tested_for_none(target, name: str) -> bool:
    """Does the source of ``target``'s module test field ``name`` against None (``cfg.qk_norm_config is not None``)?"""
    return bool(re.search(rf"\.{re.escape(name)}\b\s+is\s+(?:not\s+)?None\b", _source(target)))


def guess(target, name: str, config=None) -> tuple[object, str]:
    """``(value, why)`` for config field ``name`` of ``target``'s ``config``."""
    if tested_for_none(target, name):  # an optional part (modalities' qk_norm_config): absent
        return None, "its source tests it against None: None, absent"
    literals = compared_literals(target, name)
    if config is not None and not literals and _groups(name):  # heads per kv head (a config's __post_init__ derives it)
        heads, kv = config.role_value("num_heads"), config.role_value("num_kv_heads") or config.role_value("num_heads")
        return heads // kv, f"its name says query heads per kv head: {heads} // {kv}"
    role = hinted_role(name) if config is not None and not literals else None
    if role is not None:  # the config's value of that spec field (SpecConfig.role_value)
        return GuessedInt(config, config.role_value(role)), f"its name says {role}; read as a part, the config itself"
    if literals:
        plain = [s for s in literals if not any(w in s.lower() for w in KERNEL_WORDS)]
        value = (plain or literals)[0]
        others = [s for s in literals if s != value]
        return value, f"its source compares it with {value!r}" + (f", also {', '.join(map(repr, others))}" if others else "")
    zero = 0 if config is None else GuessedInt(config)
    return zero, "compared with no string in its source: 0, off; read as a part, the config itself"


GROUP_WORDS = ({"kv", "groups"}, {"kv", "group"}, {"key", "value", "groups"}, {"queries", "per", "kv"}, {"n", "rep"},
               {"group", "size"})
"""Word sets of a field that holds query heads per kv head (``n_kv_groups``, ``num_key_value_groups``,
``num_queries_per_kv``, ``n_rep``): what ``repeat_kv`` repeats by."""


def _groups(name: str) -> bool:
    words = set(name.lower().split("_"))
    return any(w <= words for w in GROUP_WORDS)


def hinted_role(name: str) -> str | None:
    """The one int role (width, heads, kv heads, head dim, context length) whose hints a field's name matches best
    (:data:`~attnbench.plugins.roles.HINTS`: ``embedding_size`` is the width), or None when none or two tie."""
    from attnbench.plugins.roles import INT_ROLES, PATH_WORDS, score_name

    words = set(name.lower().split("_"))
    if name.split("_")[0].lower() in ADDON_WORDS or words & (PATH_WORDS | NOT_A_ROLE):
        return None
    scores = sorted(((score_name(name, r), r) for r in INT_ROLES), reverse=True)
    best, second = scores[0], scores[1]
    return best[1] if best[0] >= 3 and best[0] > second[0] else None



NOT_A_ROLE = {"layer", "layers", "eps", "std", "init", "range", "epsilon", "seed", "batch", "type", "name", "ff", "ffn", "mlp",
              "intermediate", "inner", "expert", "experts"}
"""Words of fields that name no attention size (a model's depth, a norm's epsilon, an init scale)."""


def note(target) -> str:
    """``config fields attnbench lacks, guessed: attn_kernel_type='torch_attn' (...)`` for ``check -v``, or ``""``."""
    fields = GUESSED.get(target)
    if not fields:
        return ""
    by_why: dict[str, list[str]] = {}
    for k, (v, why) in fields.items():
        by_why.setdefault(why, []).append(k if isinstance(v, int) else f"{k}={v!r}")
    return "config fields attnbench lacks, guessed: " + "; ".join(f"{', '.join(ks)} ({why})" for why, ks in by_why.items())
