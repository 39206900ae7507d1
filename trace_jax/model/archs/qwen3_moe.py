"""Qwen3-MoE (`Qwen3MoeForCausalLM`): tensor names and config.json, both ways.

Dense layers where `mlp_only_layers` or `decoder_sparse_step` put them; QK-norm per head.
"""

from __future__ import annotations

from trace_jax.model.archs.decoder import (
  DECODER,
  LAYER,
  moe_config_from_hf,
  moe_hf_config,
  routed_experts,
)
from trace_jax.model.archs.table import Arch, NameTable, linear
from trace_jax.model.config import ModelConfig

NAMES = NameTable(
  DECODER,
  # A dense layer's feed-forward.
  linear("blocks.{layer}.mlp.w_gate", f"{LAYER}.mlp.gate_proj.weight"),
  linear("blocks.{layer}.mlp.w_up", f"{LAYER}.mlp.up_proj.weight"),
  linear("blocks.{layer}.mlp.w_down", f"{LAYER}.mlp.down_proj.weight"),
  # An MoE layer: router and routed experts (one tensor each, or transformers' fused layout).
  linear("blocks.{layer}.moe.router", f"{LAYER}.mlp.gate.weight"),
  *routed_experts(f"{LAYER}.mlp.experts", f"{LAYER}.mlp.experts"),
)


def config_from_hf(hf: dict, dtype_name: str) -> ModelConfig:
  num_layers = hf["num_hidden_layers"]
  step = hf.get("decoder_sparse_step", 1) or 1
  only = set(hf.get("mlp_only_layers") or [])
  dense_layers = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
  if hf.get("use_sliding_window"):
    raise ValueError("Qwen3-MoE with use_sliding_window=true is not supported")
  return moe_config_from_hf(
    hf,
    dtype_name,
    arch="qwen3_moe",
    moe_ffn_key="moe_intermediate_size",
    dense_layers=dense_layers,
    ffn_dim=hf.get("intermediate_size", 0) if dense_layers else 0,
    qk_norm="head",
  )


def hf_config(cfg: ModelConfig) -> dict:
  hf = moe_hf_config(
    cfg,
    hf_class=ARCH.hf_classes[0],
    num_experts_key="num_experts",
    moe_ffn_key="moe_intermediate_size",
    extra=(
      ("decoder_sparse_step", 1),
      ("use_sliding_window", False),
      ("attention_bias", False),
    ),
  )
  hf["intermediate_size"] = cfg.ffn_dim or cfg.moe_ffn_dim
  hf["mlp_only_layers"] = list(cfg.dense_layers)
  return hf


ARCH = Arch(
  name="qwen3_moe",
  hf_classes=("Qwen3MoeForCausalLM",),
  model_types=("qwen3_moe",),
  names=NAMES,
  config_from_hf=config_from_hf,
  hf_config=hf_config,
)
