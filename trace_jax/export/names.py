"""Hugging Face names and config.json of our parameters: the inverse of `model.hf`.

One `ArchNames` entry per architecture says how its checkpoints spell the MoE block, the
expert projections and the config fields; everything else (attention, norms, embedding,
LM head) is spelled the same by every architecture here. Adding an architecture is one
entry in `ARCH_NAMES` (plus its reader in `model.hf`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from trace_jax.model.config import ModelConfig
from trace_jax.model.hf import config_from_hf


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArchNames:
  """How one Hugging Face architecture names what our model calls by its own names."""

  hf_class: str  # the `architectures` entry of config.json
  moe: str  # module of the MoE block inside a layer: "mlp" or "block_sparse_moe"
  experts: tuple[str, str, str]  # an expert's (w_gate, w_up, w_down) projection names
  num_experts_key: str  # config.json field of the routed-expert count
  moe_ffn_key: str  # config.json field of an expert's width
  extra_config: tuple[tuple[str, object], ...] = ()  # fixed config.json fields


ARCH_NAMES = {
  "qwen3_moe": ArchNames(
    hf_class="Qwen3MoeForCausalLM",
    moe="mlp",
    experts=("gate_proj", "up_proj", "down_proj"),
    num_experts_key="num_experts",
    moe_ffn_key="moe_intermediate_size",
    extra_config=(
      ("decoder_sparse_step", 1),
      ("use_sliding_window", False),
      ("attention_bias", False),
    ),
  ),
  "mixtral": ArchNames(
    hf_class="MixtralForCausalLM",
    moe="block_sparse_moe",
    experts=("w1", "w3", "w2"),
    num_experts_key="num_local_experts",
    moe_ffn_key="intermediate_size",
  ),
  "olmoe": ArchNames(
    hf_class="OlmoeForCausalLM",
    moe="mlp",
    experts=("gate_proj", "up_proj", "down_proj"),
    num_experts_key="num_experts",
    moe_ffn_key="intermediate_size",
    extra_config=(("attention_bias", False),),
  ),
  # The text model as `Qwen3_5MoeForCausalLM.save_pretrained` writes it: one tensor per
  # expert, Gated DeltaNet layers under `linear_attn` (see `_qwen3_5_linear`).
  "qwen3_5_moe": ArchNames(
    hf_class="Qwen3_5MoeForCausalLM",
    moe="mlp",
    experts=("gate_proj", "up_proj", "down_proj"),
    num_experts_key="num_experts",
    moe_ffn_key="moe_intermediate_size",
    extra_config=(("model_type", "qwen3_5_moe_text"), ("attention_bias", False)),
  ),
}
# Gated DeltaNet parameters (ours under `attn`) -> (name under `linear_attn`, tensor, kind).
_QWEN3_5_LINEAR = {
  ("in_proj_qkv",): ("in_proj_qkv", "weight", "linear"),
  ("in_proj_z",): ("in_proj_z", "weight", "linear"),
  ("in_proj_b",): ("in_proj_b", "weight", "linear"),
  ("in_proj_a",): ("in_proj_a", "weight", "linear"),
  ("out_proj",): ("out_proj", "weight", "linear"),
  ("conv_weight",): ("conv1d", "weight", "conv1d"),  # ours [K, C], theirs [C, 1, K]
  ("norm", "scale"): ("norm", "weight", "plain"),
  ("A_log",): ("", "A_log", "plain"),  # parameters of linear_attn itself
  ("dt_bias",): ("", "dt_bias", "plain"),
}
_OURS = ("w_gate", "w_up", "w_down")
_DENSE = dict(zip(_OURS, ("gate_proj", "up_proj", "down_proj")))


def arch_names(arch: str) -> ArchNames:
  if arch not in ARCH_NAMES:
    raise ValueError(f"export of arch={arch!r} is not supported; supported: {sorted(ARCH_NAMES)}")
  return ARCH_NAMES[arch]


@dataclasses.dataclass(frozen=True)
class Target:
  """Where one of our parameters goes in a Hugging Face checkpoint.

  Attributes:
    module: the HF module name ("model.layers.0.self_attn.q_proj"); its tensor is
      "<module>.<tensor>" (or weight_packed, ... once quantized).
    linear: whether ours is a linear weight [in, out] (HF stores [out, in]: transposed).
    expert: for stacked experts, the expert index along axis 0 of ours; else None.
    tensor: the tensor's name inside the module ("weight"; Gated DeltaNet's "A_log", ...).
    conv1d: a depthwise conv1d kernel, ours [K, C], HF's [C, 1, K].
  """

  module: str
  linear: bool
  expert: int | None = None
  tensor: str = "weight"
  conv1d: bool = False

  @property
  def name(self) -> str:
    return f"{self.module}.{self.tensor}"


def targets(cfg: ModelConfig, path: tuple) -> Iterator[Target]:
  """The HF tensors of one of our parameters (one per expert for stacked experts)."""
  names = arch_names(cfg.arch)
  path = tuple(str(p) for p in path)
  if path == ("embed",):
    yield Target("model.embed_tokens", False)
    return
  if path == ("final_norm", "scale"):
    yield Target("model.norm", False)
    return
  if path == ("lm_head",):
    yield Target("lm_head", True)
    return
  if path[0] != "blocks":
    raise ValueError(f"no Hugging Face name for parameter {'.'.join(path)}")
  prefix = f"model.layers.{path[1]}"
  rest = path[2:]
  norms = {
    ("attn_norm", "scale"): "input_layernorm",
    ("mlp_norm", "scale"): "post_attention_layernorm",
  }
  if rest in norms:
    yield Target(f"{prefix}.{norms[rest]}", False)
  elif rest[0] == "attn" and cfg.arch == "qwen3_5_moe" and int(path[1]) in cfg.linear_layers:
    if rest[1:] not in _QWEN3_5_LINEAR:
      raise ValueError(f"no Hugging Face name for parameter {'.'.join(path)}")
    module, tensor, kind = _QWEN3_5_LINEAR[rest[1:]]
    yield Target(
      f"{prefix}.linear_attn" + (f".{module}" if module else ""),
      kind == "linear",
      tensor=tensor,
      conv1d=kind == "conv1d",
    )
  elif rest[0] == "attn" and rest[-1] == "scale":  # q_norm / k_norm
    yield Target(f"{prefix}.self_attn.{rest[1]}", False)
  elif rest[0] == "attn":
    yield Target(f"{prefix}.self_attn.{rest[1]}", True)
  elif rest[0] == "mlp":
    yield Target(f"{prefix}.mlp.{_DENSE[rest[1]]}", True)
  elif rest == ("moe", "router"):
    yield Target(f"{prefix}.{names.moe}.gate", True)
  elif rest[:2] == ("moe", "shared"):
    yield Target(f"{prefix}.{names.moe}.shared_expert.{_DENSE[rest[2]]}", True)
  elif rest == ("moe", "shared_gate"):
    yield Target(f"{prefix}.{names.moe}.shared_expert_gate", True)
  elif rest[0] == "moe" and rest[1] in _OURS:
    theirs = names.experts[_OURS.index(rest[1])]
    for e in range(cfg.num_experts):
      yield Target(f"{prefix}.{names.moe}.experts.{e}.{theirs}", True, e)
  else:
    raise ValueError(f"no Hugging Face name for parameter {'.'.join(path)}")


def hf_array(value: np.ndarray, target: Target) -> np.ndarray:
  """Our array (or one field of a packed weight) in the HF layout of `target`."""
  if target.expert is not None:
    value = value[target.expert]
  if target.conv1d:
    return np.swapaxes(value, 0, 1)[:, None, :]
  return np.swapaxes(value, -1, -2) if target.linear else value


def hf_config(cfg: ModelConfig) -> dict:
  """A config.json for a policy without a source checkpoint (e.g. an RL run from a preset).

  Raises:
    ValueError: when the architecture cannot express the ModelConfig (e.g. a shared expert
      or a QK-norm kind the HF class does not have), naming the fields that differ.
  """
  names = arch_names(cfg.arch)
  hf = {
    "architectures": [names.hf_class],
    "model_type": cfg.arch,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "num_experts_per_tok": cfg.num_experts_per_tok,
    names.num_experts_key: cfg.num_experts,
    names.moe_ffn_key: cfg.moe_ffn_dim,
    "norm_topk_prob": cfg.norm_topk_prob,
    "rms_norm_eps": cfg.rms_eps,
    "rope_theta": cfg.rope_theta,
    "max_position_embeddings": cfg.max_seq_len,
    "tie_word_embeddings": cfg.tie_embeddings,
    "router_aux_loss_coef": cfg.router_aux_loss_coef,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    **dict(names.extra_config),
  }
  if cfg.arch == "qwen3_moe":
    hf["intermediate_size"] = cfg.ffn_dim or cfg.moe_ffn_dim
    hf["mlp_only_layers"] = list(cfg.dense_layers)
  if cfg.arch == "mixtral":
    hf["sliding_window"] = cfg.sliding_window
  if cfg.arch == "olmoe":
    hf["clip_qkv"] = cfg.clip_qkv
  if cfg.arch == "qwen3_5_moe":
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
  back = config_from_hf(hf)
  # delta_chunk_size is how we compute the delta rule, not a property of the checkpoint.
  ignored = ("name", "dtype", "dispatch", "init_std", "delta_chunk_size") + (
    () if cfg.dense_layers else ("ffn_dim",)
  )
  fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ignored]
  differ = [f for f in fields if getattr(back, f) != getattr(cfg, f)]
  if differ:
    raise ValueError(
      f"the policy's ModelConfig cannot be written as a {cfg.arch} config.json: "
      f"fields {differ} would read back as "
      f"{[getattr(back, f) for f in differ]}, not {[getattr(cfg, f) for f in differ]}"
    )
  return hf
