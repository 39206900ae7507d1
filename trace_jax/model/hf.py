"""Load Hugging Face checkpoints of Qwen3-MoE, Qwen3.5-MoE, Mixtral and OLMoE: `from_hf(path)`.

Reads config.json and *.safetensors (one file, or shards through
model.safetensors.index.json) with NumPy memory maps, so no torch or transformers is
needed. Linear weights are stored [out, in] by Hugging Face and [in, out] here; experts
are stacked [E, in, out]. Both on-disk expert layouts exist in the wild: one tensor per
expert (`experts.{e}.gate_proj.weight`, Mixtral's `w1/w2/w3`) and fused 3-D tensors
(`experts.gate_up_proj` [E, 2f, d], `experts.down_proj` [E, d, f]); both load.
Qwen3.5-MoE's own names, config nesting and skipped tensors live in `hf_qwen3_5`.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from trace_jax.model import compressed
from trace_jax.model import hf_qwen3_5
from trace_jax.model.config import ModelConfig, decoder_fields_from_hf
from trace_jax.model.transformer import Transformer
from trace_jax.utils.io import read_json_object

SUPPORTED = {
  "qwen3_moe": ("Qwen3MoeForCausalLM",),
  "mixtral": ("MixtralForCausalLM",),
  "olmoe": ("OlmoeForCausalLM",),
  "qwen3_5_moe": hf_qwen3_5.ARCHITECTURES,
}
_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
  "F8_E4M3": ml_dtypes.float8_e4m3fn,
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Tensors of one .safetensors file as read-only NumPy views of a memory map.

  Raises:
    ValueError: naming the file (and the tensor) when it is not a whole safetensors file.
  """
  raw = (
    np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)
  )
  header, base = _safetensors_header(path, raw)
  tensors = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    _check_tensor_entry(path, name, info, len(raw) - base)
    start, end = info["data_offsets"]
    tensors[name] = (
      raw[base + start : base + end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    )
  return tensors


def _safetensors_header(path: str, raw) -> tuple[dict, int]:
  """(header dict, offset of the data) of a safetensors file, or a ValueError naming it."""
  if len(raw) < 8:
    raise ValueError(f"{path}: not a safetensors file ({len(raw)} bytes; truncated?)")
  header_len = int(np.frombuffer(raw[:8].tobytes(), "<u8")[0])
  if header_len > len(raw) - 8:
    raise ValueError(
      f"{path}: the header claims {header_len} bytes but the file has "
      f"{len(raw)} (truncated, or not a safetensors file)"
    )
  try:
    header = json.loads(raw[8 : 8 + header_len].tobytes())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from e
  if not isinstance(header, dict):
    raise ValueError(f"{path}: the safetensors header is not a JSON object")
  return header, 8 + header_len


def _check_tensor_entry(path: str, name: str, info, data_bytes: int) -> None:
  """A header entry that the file can actually back (dtype, shape, offsets in range)."""
  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
    raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {info!r}")
  if info["dtype"] not in _DTYPES:
    raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
  start, end = info["data_offsets"]
  expected = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(_DTYPES[info["dtype"]]).itemsize
  if not 0 <= start <= end <= data_bytes or end - start != expected:
    raise ValueError(
      f"{path}: tensor {name!r} ({info['dtype']} {info['shape']}, {expected} bytes) "
      f"has data offsets [{start}, {end}) but the file holds {data_bytes} data "
      f"bytes (truncated or damaged file)"
    )


def _read_checkpoint(path: str) -> dict[str, np.ndarray]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise ValueError(f"{path} holds no *.safetensors files")
  tensors = {}
  for name in files:
    tensors.update(read_safetensors(os.path.join(path, name)))
  return tensors


def _arch(hf: dict) -> str:
  model_type = hf.get("model_type")
  archs = hf.get("architectures") or []
  if hf_qwen3_5.is_qwen3_5(hf):
    return "qwen3_5_moe"
  for arch, classes in SUPPORTED.items():
    if model_type == arch or any(a in classes for a in archs):
      return arch
  supported = ", ".join(f"{k} ({', '.join(v)})" for k, v in SUPPORTED.items())
  raise ValueError(
    f"unsupported architecture model_type={model_type!r} architectures={archs}; "
    f"supported: {supported}"
  )


def _rope_theta(hf: dict) -> float:
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
_FULL_ROPE_ARCHS = ("qwen3_moe", "mixtral", "olmoe")


def _check_supported(hf: dict, arch: str) -> None:
  """Refuse a config.json option this implementation would silently compute otherwise
  (for Qwen3.5, the text config's options: `hf_qwen3_5.text_config`)."""
  if arch == "qwen3_5_moe":
    hf = hf_qwen3_5.text_config(hf)
  for option, allowed in _SUPPORTED_OPTIONS.items():
    if option == "partial_rotary_factor" and arch not in _FULL_ROPE_ARCHS:
      continue
    if option in hf and hf[option] not in allowed:
      raise ValueError(
        f"{option}={hf[option]!r} is not supported; supported: "
        f"{[a for a in allowed if a is not None]}"
      )


def config_from_hf(hf: dict, dtype=jnp.float32) -> ModelConfig:
  """A ModelConfig from a Hugging Face config.json dict (either spelling of each field)."""
  arch = _arch(hf)
  _check_supported(hf, arch)
  if arch == "qwen3_5_moe":
    return hf_qwen3_5.config_from_hf(
      hf, "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"
    )
  num_layers = hf["num_hidden_layers"]
  num_experts = hf.get("num_experts", hf.get("num_local_experts"))
  if num_experts is None:
    raise ValueError("config.json has neither num_experts nor num_local_experts")
  dense_layers: tuple[int, ...] = ()
  if arch == "qwen3_moe":
    step = hf.get("decoder_sparse_step", 1) or 1
    only = set(hf.get("mlp_only_layers") or [])
    dense_layers = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
    if hf.get("use_sliding_window"):
      raise ValueError("Qwen3-MoE with use_sliding_window=true is not supported")
  moe_ffn = hf["moe_intermediate_size"] if arch == "qwen3_moe" else hf["intermediate_size"]
  return ModelConfig(
    **decoder_fields_from_hf(hf, arch),
    arch=arch,
    num_experts=num_experts,
    num_experts_per_tok=hf["num_experts_per_tok"],
    moe_ffn_dim=moe_ffn,
    ffn_dim=hf.get("intermediate_size", 0) if dense_layers else 0,
    dense_layers=dense_layers,
    norm_topk_prob=True if arch == "mixtral" else bool(hf.get("norm_topk_prob", False)),
    qk_norm={"qwen3_moe": "head", "olmoe": "full", "mixtral": "none"}[arch],
    clip_qkv=hf.get("clip_qkv"),
    rope_theta=_rope_theta(hf),
    rms_eps=hf.get("rms_norm_eps", 1e-6),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    sliding_window=hf.get("sliding_window") if arch == "mixtral" else None,
    max_seq_len=hf.get("max_position_embeddings", 2048),
    router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
    dtype="bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32",
  )


def _transpose(a):
  return np.swapaxes(a, -1, -2)


def _tensor_map(cfg: ModelConfig, tensors) -> dict[tuple, Callable[[], np.ndarray]]:
  """Our parameter path -> a function that reads it (raising with the HF name if absent)."""

  def get(name):
    if name not in tensors:
      raise ValueError(f"checkpoint is missing tensor {name!r}")
    return tensors[name]

  def first_present(*names):
    return next((n for n in names if n in tensors), names[0])

  spec: dict[tuple, Callable[[], np.ndarray]] = {
    ("embed",): lambda: get("model.embed_tokens.weight"),
    ("final_norm", "scale"): lambda: get("model.norm.weight"),
  }
  if not cfg.tie_embeddings:
    spec[("lm_head",)] = lambda: _transpose(get("lm_head.weight"))
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}"
    block = ("blocks", i)
    spec[block + ("attn_norm", "scale")] = lambda p=p: get(f"{p}.input_layernorm.weight")
    spec[block + ("mlp_norm", "scale")] = lambda p=p: get(f"{p}.post_attention_layernorm.weight")
    if cfg.arch == "qwen3_5_moe":  # Gated DeltaNet / gated attention, shared expert
      spec.update(hf_qwen3_5.layer_tensor_map(cfg, i, get))
    else:
      for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        spec[block + ("attn", proj)] = lambda p=p, proj=proj: _transpose(
          get(f"{p}.self_attn.{proj}.weight")
        )
      if cfg.qk_norm != "none":
        for norm in ("q_norm", "k_norm"):
          spec[block + ("attn", norm, "scale")] = lambda p=p, n=norm: get(
            f"{p}.self_attn.{n}.weight"
          )
    if i in cfg.dense_layers:
      for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        spec[block + ("mlp", ours)] = lambda p=p, t=theirs: _transpose(get(f"{p}.mlp.{t}.weight"))
      continue
    moe = first_present(f"{p}.mlp.gate.weight", f"{p}.block_sparse_moe.gate.weight")
    prefix = moe[: -len(".gate.weight")]
    spec[block + ("moe", "router")] = lambda n=moe: _transpose(get(n))
    names = {
      "w_gate": ("gate_proj", "w1"),
      "w_up": ("up_proj", "w3"),
      "w_down": ("down_proj", "w2"),
    }
    fused = f"{prefix}.experts.gate_up_proj" in tensors

    def experts(ours, prefix=prefix, fused=fused):
      if fused:
        if ours == "w_down":
          return _transpose(get(f"{prefix}.experts.down_proj"))
        gate_up = get(f"{prefix}.experts.gate_up_proj")  # [E, 2f, d]
        half = gate_up.shape[1] // 2
        return _transpose(gate_up[:, :half] if ours == "w_gate" else gate_up[:, half:])
      f, d = cfg.moe_ffn_dim, cfg.d_model
      expected = (d, f) if ours == "w_down" else (f, d)  # Hugging Face [out, in]
      stacked = []
      for e in range(cfg.num_experts):
        name = first_present(*(f"{prefix}.experts.{e}.{n}.weight" for n in names[ours]))
        if tuple(get(name).shape) != expected:
          raise ValueError(
            f"tensor {name!r} has shape {tuple(get(name).shape)}; the config implies {expected}"
          )
        stacked.append(_transpose(get(name)))
      return np.stack(stacked)

    for ours in names:
      spec[block + ("moe", ours)] = lambda ours=ours, f=experts: f(ours)
  return spec


def _used_names(cfg: ModelConfig, tensors) -> set[str]:
  """Checkpoint names the mapping reads (to report tensors nothing would load)."""
  used = set()

  class Spy(dict):
    def __contains__(self, name):
      return name in tensors

    def __getitem__(self, name):
      used.add(name)
      return tensors[name]

  for read in _tensor_map(cfg, Spy()).values():
    read()
  return used


def _read_config(config_path: str, dtype) -> tuple[ModelConfig, dict]:
  """config_from_hf of a config.json file, and the file's dict, with errors that name it."""
  hf = read_json_object(config_path)
  try:
    return config_from_hf(hf, dtype), hf
  except KeyError as e:
    raise ValueError(f"{config_path} lacks the required field {e.args[0]!r}") from e
  except (ValueError, TypeError) as e:
    raise ValueError(f"{config_path}: {e}") from e


def from_hf(path: str, dtype=jnp.float32, **overrides) -> Transformer:
  """A Transformer with the weights of a local Hugging Face checkpoint directory.

  Args:
    path: directory with config.json and *.safetensors (sharded index too); a
      compressed-tensors FP4 checkpoint loads dequantized (`model.compressed`).
    dtype: parameter and compute dtype (float32 or bfloat16).
    **overrides: ModelConfig fields a checkpoint does not hold, how this run computes
      (e.g. remat=True); they change no weight's shape.

  Raises:
    ValueError: unknown architecture (listing the supported ones), a missing tensor, a
      tensor of the wrong shape, or tensors in the checkpoint that nothing loads.
  """
  path = os.path.abspath(path)
  config_path = os.path.join(path, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"{path} has no config.json")
  cfg, hf = _read_config(config_path, dtype)
  cfg = cfg.replace(**overrides)
  tensors = compressed.decompress(hf, _read_checkpoint(path))  # FP4 checkpoints: dequantized
  if cfg.arch == "qwen3_5_moe":  # published layout: rename, skip mtp.* / model.visual.*
    tensors, _ = hf_qwen3_5.text_tensors(tensors)
  spec = _tensor_map(cfg, tensors)

  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(state))
  missing_from_map = [p for p in flat if p not in spec]
  if missing_from_map:
    raise ValueError(f"no checkpoint mapping for parameters {missing_from_map}")
  for param_path, variable in flat.items():
    array = np.asarray(spec[param_path](), dtype=np.float32)
    expected = variable.get_value().shape
    if array.shape != expected:
      name = ".".join(str(p) for p in param_path)
      raise ValueError(f"tensor for {name} has shape {array.shape}; the config implies {expected}")
    variable.set_value(jnp.asarray(array, dtype))
  unused = sorted(
    n for n in set(tensors) - _used_names(cfg, tensors) if not n.endswith(_IGNORED_SUFFIXES)
  )
  if unused:
    raise ValueError(f"checkpoint tensors that nothing loads (wrong architecture?): {unused[:8]}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))
