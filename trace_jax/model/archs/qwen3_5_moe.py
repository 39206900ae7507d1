"""Qwen3.5-MoE (text policy): tensor names and config.json, both ways, both layouts.

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

from trace_jax.model.archs.decoder import (
  DECODER,
  LAYER,
  check_supported,
  moe_hf_config,
  routed_experts,
)
from trace_jax.model.archs.table import Arch, NameTable, conv1d, linear, plain
from trace_jax.model.config import ModelConfig, decoder_fields_from_hf, hybrid_layer_types

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
SKIPPED_PREFIXES = ("mtp.", "model.visual.")  # multi-token prediction head, vision tower
_PUBLISHED_PREFIX = "model.language_model."
_DEFAULT_PARTIAL_ROTARY = 0.25


def text_config(hf: dict) -> dict:
  """The text model's config dict (nested under text_config in the published layout)."""
  return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def config_from_hf(hf: dict, dtype_name: str) -> ModelConfig:
  """A ModelConfig from a Qwen3.5-MoE config.json (either layout)."""
  text = text_config(hf)
  check_supported(text, skip=("partial_rotary_factor",))  # partial RoPE is computed here
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


_LINEAR = f"{LAYER}.linear_attn"
_MLP = f"{LAYER}.mlp"
# The text layout's names (`text_tensors` renames the published layout's to these).
NAMES = NameTable(
  DECODER,  # the norms, embedding, LM head and the gated full-attention layers
  # Gated DeltaNet layers (ours under `attn`, theirs under `linear_attn`).
  linear("blocks.{layer}.attn.in_proj_qkv", f"{_LINEAR}.in_proj_qkv.weight"),
  linear("blocks.{layer}.attn.in_proj_z", f"{_LINEAR}.in_proj_z.weight"),
  linear("blocks.{layer}.attn.in_proj_b", f"{_LINEAR}.in_proj_b.weight"),
  linear("blocks.{layer}.attn.in_proj_a", f"{_LINEAR}.in_proj_a.weight"),
  linear("blocks.{layer}.attn.out_proj", f"{_LINEAR}.out_proj.weight"),
  conv1d("blocks.{layer}.attn.conv_weight", f"{_LINEAR}.conv1d.weight"),
  plain("blocks.{layer}.attn.norm.scale", f"{_LINEAR}.norm.weight"),
  plain("blocks.{layer}.attn.A_log", f"{_LINEAR}.A_log"),
  plain("blocks.{layer}.attn.dt_bias", f"{_LINEAR}.dt_bias"),
  # MoE: router, routed experts (one tensor each, or the published fused layout), the gated
  # shared expert.
  linear("blocks.{layer}.moe.router", f"{_MLP}.gate.weight"),
  *routed_experts(f"{_MLP}.experts", f"{_MLP}.experts"),
  linear("blocks.{layer}.moe.shared.w_gate", f"{_MLP}.shared_expert.gate_proj.weight"),
  linear("blocks.{layer}.moe.shared.w_up", f"{_MLP}.shared_expert.up_proj.weight"),
  linear("blocks.{layer}.moe.shared.w_down", f"{_MLP}.shared_expert.down_proj.weight"),
  linear("blocks.{layer}.moe.shared_gate", f"{_MLP}.shared_expert_gate.weight"),
)


def hf_config(cfg: ModelConfig) -> dict:
  """The text model's config.json as `Qwen3_5MoeForCausalLM.save_pretrained` writes it."""
  hf = moe_hf_config(
    cfg,
    hf_class=ARCHITECTURES[0],
    num_experts_key="num_experts",
    moe_ffn_key="moe_intermediate_size",
    extra=(("model_type", "qwen3_5_moe_text"), ("attention_bias", False)),
  )
  del hf["rope_theta"]
  hf.update(
    layer_types=list(cfg.layer_types),
    rope_parameters={
      "rope_type": "default",
      "rope_theta": cfg.rope_theta,
      "partial_rotary_factor": cfg.partial_rotary_factor,
    },
    shared_expert_intermediate_size=cfg.shared_expert_dim,
    linear_num_key_heads=cfg.linear_num_key_heads,
    linear_num_value_heads=cfg.linear_num_value_heads,
    linear_key_head_dim=cfg.linear_key_head_dim,
    linear_value_head_dim=cfg.linear_value_head_dim,
    linear_conv_kernel_dim=cfg.linear_conv_kernel,
  )
  return hf


ARCH = Arch(
  name="qwen3_5_moe",
  hf_classes=ARCHITECTURES,
  model_types=MODEL_TYPES,
  names=NAMES,
  config_from_hf=config_from_hf,
  hf_config=hf_config,
  text_tensors=lambda tensors: text_tensors(tensors)[0],
)
