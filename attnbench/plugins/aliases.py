"""The names a constructor's parameters (and a config's fields) bind to, and the values a spec gives them: a leaf
module, so that what builds helpers of a class's own code (:mod:`~attnbench.plugins.helper_args`) reads them without
importing the binder."""

from __future__ import annotations

from dataclasses import fields

from attnbench.plugins.mla import latent_dim
from attnbench.spec import AttnSpec

ALIASES: dict[str, tuple[str, ...]] = {
    "d_in": ("d_in", "d_model", "embed_dim", "n_embd", "hidden_size", "dim", "emb_dim", "embedding_dim",
             "n_embed", "d_embed", "input_dim", "in_features", "in_dim"),
    "d_out": ("d_out", "out_features", "output_dim", "out_dim", "dim_out"),
    "num_heads": ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads", "nhead", "num_head",
                  "head_num", "num_att_heads", "att_heads"),
    # num_kv_groups: the book's (chapter 4) name for the number of key/value heads
    # n_local_heads (gpt-fast), n_query_groups (litgpt): the number of key/value heads under another name
    "num_kv_heads": ("num_kv_heads", "n_kv_heads", "n_kv_head", "num_key_value_heads", "n_key_value_heads", "kv_heads",
                     "num_kv_groups",
                     "n_local_heads", "n_query_groups"),
    "context_length": ("context_length", "block_size", "max_seq_len", "max_position_embeddings", "max_len",
                       "max_seq_length", "seq_len", "context_len", "n_ctx", "n_positions", "max_length",
                       "sequence_len", "sequence_length"),
    "dropout": ("dropout", "attn_pdrop", "attention_dropout", "p", "attn_dropout", "dropout_p", "attn_drop",
                "attention_probs_dropout_prob", "dropout_rate", "attn_dropout_rate", "dropout_prob"),
    "qkv_bias": ("qkv_bias", "bias", "use_bias", "attention_bias", "add_bias", "use_qkv_bias"),
    "head_dim": ("head_dim", "dim_head", "head_size", "d_head", "d_k", "n_embd_head", "dim_heads", "n_embd_per_head",
                 "dim_per_head"),
    # window_size is bound (a class that declares sliding_window gets the window through it) but is no
    # evidence of a sliding window: it can size a cache (the book's optimized KV cache), see WINDOW_EVIDENCE
    "window": ("window", "sliding_window", "sliding_window_size", "attention_window", "window_size"),
    "causal": ("causal", "is_causal"),
    # issue 26: what a class that owns its RoPE, QK-norm, score scale or soft-capping is built with
    "rope_theta": ("rope_theta", "theta", "base", "rope_base", "rotary_base", "rotary_emb_base"),
    "rope_scaling": ("rope_scaling",),  # a keyword gets the spec's RopeScaling; a config the HF dict (hf_rope_scaling)
    # partial rotary (GPT-J's rotary_dim, GPT-NeoX's rotary_ndims): the rotated width of each head, all of it by default
    "rope_head_dim": ("rope_head_dim", "rotary_dim", "rotary_ndims", "rope_dim", "partial_rotary_dim"),
    # ... or the rotated fraction of each head (GPT-NeoX's rotary_pct, Hugging Face's partial_rotary_factor)
    "rope_fraction": ("partial_rotary_factor", "rotary_pct", "rotary_percentage", "rope_pct", "rotary_fraction"),
    "qk_norm": ("qk_norm", "use_qk_norm", "qk_layernorm"),
    "norm_eps": ("norm_eps", "rms_norm_eps", "qk_norm_eps"),
    "query_pre_attn_scalar": ("query_pre_attn_scalar",),
    "softcap": ("softcap", "attn_logit_softcapping", "logit_softcapping", "softcapping"),
    # issue 37 (attnbench.correctness.masks): what a class that declares masks= is built with
    "alibi": ("alibi", "use_alibi"),
    "prefix": ("prefix", "prefix_len", "prefix_length"),
    "documents": ("documents", "document_starts"),
    "sinks": ("sinks", "use_sinks", "attention_sinks"),
    # MLA: the width of the key/value latent, d_out // 4 (plugins.mla)
    "latent_dim": ("latent_dim", "kv_lora_rank", "d_latent", "latent_size", "kv_latent_dim"),
}
"""Spec field -> the constructor parameter (and config field) names it binds to."""
BY_NAME = {alias: field for field, names in ALIASES.items() for alias in names}
"""Constructor parameter (or config field) name -> the spec field it binds to."""


def spec_values(spec: AttnSpec) -> dict[str, object]:
    """Every value a constructor can ask for: the spec's fields, ``head_dim``, and ``num_kv_heads``
    (the spec's own when it has one, else ``num_heads``)."""
    values = {f.name: getattr(spec, f.name) for f in fields(spec)}
    values["num_kv_heads"] = getattr(spec, "num_kv_heads", None) or spec.num_heads
    values["head_dim"] = spec.head_dim
    scale = getattr(spec, "scale", None)  # Gemma: scores * query_pre_attn_scalar ** -0.5
    values["query_pre_attn_scalar"] = scale ** -2 if scale is not None else spec.head_dim
    values["latent_dim"] = latent_dim(spec)
    values["rope_head_dim"] = getattr(spec, "rope_head_dim", None) or spec.head_dim  # partial rotary: all of it unless set
    values["rope_fraction"] = values["rope_head_dim"] / spec.head_dim
    values["d_context"] = spec.d_in  # the width of a second input (cross-attention's context): x's, for self-attention
    values["d_ff"] = 4 * spec.d_in  # a feed-forward width: only a whole block takes one (plugins.roles)
    return values
