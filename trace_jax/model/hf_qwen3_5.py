"""Hugging Face Qwen3.5-MoE checkpoints (text policy): config and tensor names, both layouts.

Two layouts exist in the wild:
  text     what `Qwen3_5MoeForCausalLM.save_pretrained` writes: the text config at top level
           (model_type "qwen3_5_moe_text"), `model.layers.N...`, one tensor per expert;
  published  the released Qwen3.5 checkpoints: a multimodal config with the text config
           nested under "text_config" (model_type "qwen3_5_moe"), `model.language_model.layers.N...`,
           experts fused in 3-D tensors (`experts.gate_up_proj` [E, 2f, d], `experts.down_proj`
           [E, d, f]), plus multi-token-prediction (`mtp.*`) and vision-tower (`model.visual.*`)
           tensors that a text policy does not use: they are skipped by name and reported.
Traps (all from transformers' Qwen3_5MoeTextConfig and modeling code):
  - partial_rotary_factor defaults to 0.25 when the config does not give it;
  - `layer_types` overrides `full_attention_interval` (default 4) when both are present;
  - the DeltaNet output norm (`linear_attn.norm`) scales by w, every other norm by (1 + w);
  - q_proj's output is [query | gate] per head (the output gate of gated attention);
  - RoPE is written as interleaved M-RoPE, which for text (equal t/h/w positions) is plain RoPE.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from trace_jax.model.config import ModelConfig, decoder_fields_from_hf, hybrid_layer_types

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
SKIPPED_PREFIXES = ("mtp.", "model.visual.")  # multi-token prediction head, vision tower
_PUBLISHED_PREFIX = "model.language_model."
_DEFAULT_PARTIAL_ROTARY = 0.25


def is_qwen3_5(hf: dict) -> bool:
  return hf.get("model_type") in MODEL_TYPES or any(
    a in ARCHITECTURES for a in hf.get("architectures") or []
  )


def text_config(hf: dict) -> dict:
  """The text model's config dict (nested under text_config in the published layout)."""
  return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def config_from_hf(hf: dict, dtype_name: str) -> ModelConfig:
  """A ModelConfig from a Qwen3.5-MoE config.json (either layout)."""
  text = text_config(hf)
  rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
  if rope.get("rope_type", "default") != "default":
    raise ValueError(
      f"rope_type={rope.get('rope_type')!r} (rope scaling) is not supported; only 'default'"
    )
  theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
  partial = rope.get(
    "partial_rotary_factor", text.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY)
  )
  num_layers = text["num_hidden_layers"]
  layer_types = text.get("layer_types")
  if layer_types is None:
    layer_types = hybrid_layer_types(num_layers, text.get("full_attention_interval", 4))
  tie = text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))
  return ModelConfig(
    **decoder_fields_from_hf(
      {**text, "_name_or_path": hf.get("_name_or_path", "qwen3_5_moe")}, "qwen3_5_moe"
    ),
    arch="qwen3_5_moe",
    num_experts=text["num_experts"],
    num_experts_per_tok=text["num_experts_per_tok"],
    moe_ffn_dim=text["moe_intermediate_size"],
    shared_expert_dim=text.get("shared_expert_intermediate_size", 0),
    shared_expert_gate=bool(text.get("shared_expert_intermediate_size", 0)),
    norm_topk_prob=True,  # Qwen3_5MoeTopKRouter always renormalises the top-k
    qk_norm="head",
    rope_theta=float(theta),
    rms_eps=text.get("rms_norm_eps", 1e-6),
    tie_embeddings=bool(tie),
    max_seq_len=text.get("max_position_embeddings", 2048),
    router_aux_loss_coef=text.get("router_aux_loss_coef", 0.001),
    dtype=dtype_name,
    layer_types=tuple(layer_types),
    attn_output_gate=True,
    partial_rotary_factor=float(partial),
    zero_centered_norm=True,
    linear_num_key_heads=text.get("linear_num_key_heads", 16),
    linear_num_value_heads=text.get("linear_num_value_heads", 32),
    linear_key_head_dim=text.get("linear_key_head_dim", 128),
    linear_value_head_dim=text.get("linear_value_head_dim", 128),
    linear_conv_kernel=text.get("linear_conv_kernel_dim", 4),
  )


def text_tensors(tensors: dict) -> tuple[dict, dict[str, int]]:
  """The text policy's tensors under the text-layout names, and what was skipped.

  Returns:
    (tensors with `model.language_model.` renamed to `model.`, {skipped prefix: count}).
  """
  out, skipped = {}, {}
  for name, array in tensors.items():
    prefix = next((p for p in SKIPPED_PREFIXES if name.startswith(p)), None)
    if prefix is not None:
      skipped[prefix] = skipped.get(prefix, 0) + 1
      continue
    if name.startswith(_PUBLISHED_PREFIX):
      name = "model." + name[len(_PUBLISHED_PREFIX) :]
    out[name] = array
  if skipped:
    logging.warning(
      "Qwen3.5 checkpoint: skipped tensors a text policy does not use: %s",
      ", ".join(f"{n} {p}*" for p, n in sorted(skipped.items())),
    )
  return out, skipped


def _transpose(a):
  return np.swapaxes(a, -1, -2)


def layer_tensor_map(cfg: ModelConfig, layer: int, get) -> dict[tuple, Callable[[], np.ndarray]]:
  """Our parameter path -> reader for the token mixer of one layer (the norms, the MoE and
  the rest are the generic Qwen-MoE names that `hf._tensor_map` handles)."""
  p, block = f"model.layers.{layer}", ("blocks", layer)
  spec: dict[tuple, Callable[[], np.ndarray]] = {}
  if layer in cfg.linear_layers:
    attn = f"{p}.linear_attn"
    for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
      spec[block + ("attn", proj)] = lambda n=f"{attn}.{proj}.weight": _transpose(get(n))
    # [conv_dim, 1, K] -> [K, conv_dim]
    spec[block + ("attn", "conv_weight")] = lambda: _transpose(get(f"{attn}.conv1d.weight")[:, 0])
    spec[block + ("attn", "A_log")] = lambda: get(f"{attn}.A_log")
    spec[block + ("attn", "dt_bias")] = lambda: get(f"{attn}.dt_bias")
    spec[block + ("attn", "norm", "scale")] = lambda: get(f"{attn}.norm.weight")
  else:
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      spec[block + ("attn", proj)] = lambda n=f"{p}.self_attn.{proj}.weight": _transpose(get(n))
    for norm in ("q_norm", "k_norm"):
      spec[block + ("attn", norm, "scale")] = lambda n=f"{p}.self_attn.{norm}.weight": get(n)
  shared = f"{p}.mlp.shared_expert"
  for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
    spec[block + ("moe", "shared", ours)] = lambda n=f"{shared}.{theirs}.weight": _transpose(get(n))
  spec[block + ("moe", "shared_gate")] = lambda: _transpose(
    get(f"{p}.mlp.shared_expert_gate.weight")
  )
  return spec
