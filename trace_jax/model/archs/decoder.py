"""What the Hugging Face MoE decoders here spell alike: the rows of their name tables outside
the feed-forward (embedding, norms, attention, LM head) and the config.json fields of the
Qwen3-MoE / Mixtral / OLMoE family, read and written."""

from __future__ import annotations

from trace_jax.model.archs.table import experts, linear, plain
from trace_jax.model.config import ModelConfig, decoder_fields_from_hf

LAYER = "model.layers.{layer}"


# Embedding, final norm, LM head, the two pre-norms and softmax attention (with its QK norms).
def routed_experts(
  per_expert: str, fused: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> tuple:
  """The routed experts' gate, up and down weights: one tensor per expert
  (`{per_expert}.{expert}.<name>.weight`, `names` in that order) or transformers' fused
  layout (`{fused}.gate_up_proj` [E, 2f, d], `{fused}.down_proj`)."""
  gate, up, down = names
  return (
    experts(
      "blocks.{layer}.moe.w_gate",
      f"{per_expert}.{{expert}}.{gate}.weight",
      fused=(f"{fused}.gate_up_proj", 0, 2),
    ),
    experts(
      "blocks.{layer}.moe.w_up",
      f"{per_expert}.{{expert}}.{up}.weight",
      fused=(f"{fused}.gate_up_proj", 1, 2),
    ),
    experts(
      "blocks.{layer}.moe.w_down",
      f"{per_expert}.{{expert}}.{down}.weight",
      fused=(f"{fused}.down_proj", 0, 1),
    ),
  )


DECODER = (
  plain("embed", "model.embed_tokens.weight"),
  plain("final_norm.scale", "model.norm.weight"),
  linear("lm_head", "lm_head.weight"),
  plain("blocks.{layer}.attn_norm.scale", f"{LAYER}.input_layernorm.weight"),
  plain("blocks.{layer}.mlp_norm.scale", f"{LAYER}.post_attention_layernorm.weight"),
  linear("blocks.{layer}.attn.q_proj", f"{LAYER}.self_attn.q_proj.weight"),
  linear("blocks.{layer}.attn.k_proj", f"{LAYER}.self_attn.k_proj.weight"),
  linear("blocks.{layer}.attn.v_proj", f"{LAYER}.self_attn.v_proj.weight"),
  linear("blocks.{layer}.attn.o_proj", f"{LAYER}.self_attn.o_proj.weight"),
  plain("blocks.{layer}.attn.q_norm.scale", f"{LAYER}.self_attn.q_norm.weight"),
  plain("blocks.{layer}.attn.k_norm.scale", f"{LAYER}.self_attn.k_norm.weight"),
)


def rope_theta(hf: dict) -> float:
  """RoPE base from either spelling (top-level rope_theta or rope_parameters); refuses
  rope scaling, which this implementation does not compute."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling")
  rope_type = params.get("rope_type", (scaling or {}).get("rope_type", "default"))
  if rope_type != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
    raise ValueError(f"rope_type={rope_type!r} (rope scaling) is not supported; only 'default'")
  theta = hf.get("rope_theta", params.get("rope_theta"))
  return float(theta if theta is not None else 10000.0)


# config.json options whose other values this implementation does not compute: refused by
# name rather than loaded and run as something else.
_SUPPORTED_OPTIONS = {
  "hidden_act": ("silu", "swish"),  # the SwiGLU experts
  "attention_bias": (False, None),
  "mlp_bias": (False, None),
  "partial_rotary_factor": (1, 1.0, None),  # full RoPE (Qwen3-MoE, Mixtral, OLMoE)
}


def check_supported(hf: dict, *, skip: tuple[str, ...] = ()) -> None:
  """Refuse a config.json option this implementation would silently compute otherwise.

  Args:
    skip: options the family computes itself (Qwen3.5's partial rotary factor).
  """
  for option, allowed in _SUPPORTED_OPTIONS.items():
    if option in hf and option not in skip and hf[option] not in allowed:
      raise ValueError(
        f"{option}={hf[option]!r} is not supported; supported: "
        f"{[a for a in allowed if a is not None]}"
      )


def moe_config_from_hf(
  hf: dict, dtype_name: str, *, arch: str, moe_ffn_key: str, **fields
) -> ModelConfig:
  """A ModelConfig from the config.json fields the Qwen3-MoE / Mixtral / OLMoE family names
  alike (either spelling of each), and `fields`, the family's own.

  Args:
    moe_ffn_key: the config.json field of an expert's width.
    **fields: ModelConfig fields the family sets itself (e.g. qk_norm).
  """
  check_supported(hf)
  num_experts = hf.get("num_experts", hf.get("num_local_experts"))
  if num_experts is None:
    raise ValueError("config.json has neither num_experts nor num_local_experts")
  common = dict(
    **decoder_fields_from_hf(hf, arch),
    arch=arch,
    num_experts=num_experts,
    num_experts_per_tok=hf["num_experts_per_tok"],
    moe_ffn_dim=hf[moe_ffn_key],
    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    clip_qkv=hf.get("clip_qkv"),
    rope_theta=rope_theta(hf),
    rms_eps=hf.get("rms_norm_eps", 1e-6),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    max_seq_len=hf.get("max_position_embeddings", 2048),
    router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
    dtype=dtype_name,
  )
  return ModelConfig(**{**common, **fields})


def moe_hf_config(
  cfg: ModelConfig,
  *,
  hf_class: str,
  num_experts_key: str,
  moe_ffn_key: str,
  extra: tuple[tuple[str, object], ...] = (),
) -> dict:
  """The config.json fields the family names alike, for a policy without a source checkpoint.

  Args:
    hf_class: the `architectures` entry.
    num_experts_key, moe_ffn_key: the family's fields of the routed-expert count and width.
    extra: fixed config.json fields of the family.
  """
  return {
    "architectures": [hf_class],
    "model_type": cfg.arch,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "num_experts_per_tok": cfg.num_experts_per_tok,
    num_experts_key: cfg.num_experts,
    moe_ffn_key: cfg.moe_ffn_dim,
    "norm_topk_prob": cfg.norm_topk_prob,
    "rms_norm_eps": cfg.rms_eps,
    "rope_theta": cfg.rope_theta,
    "max_position_embeddings": cfg.max_seq_len,
    "tie_word_embeddings": cfg.tie_embeddings,
    "router_aux_loss_coef": cfg.router_aux_loss_coef,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    **dict(extra),
  }
