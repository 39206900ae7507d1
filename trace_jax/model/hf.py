"""Load Hugging Face checkpoints of Qwen3-MoE, Qwen3.5-MoE, Mixtral and OLMoE: `from_hf(path)`.

Reads config.json and *.safetensors (one file, or shards through
model.safetensors.index.json) with NumPy memory maps, so no torch or transformers is
needed. Linear weights are stored [out, in] by Hugging Face and [in, out] here; experts
are stacked [E, in, out]. Both on-disk expert layouts exist in the wild: one tensor per
expert (`experts.{e}.gate_proj.weight`, Mixtral's `w1/w2/w3`) and fused 3-D tensors
(`experts.gate_up_proj` [E, 2f, d], `experts.down_proj` [E, d, f]); both load.
Each family's tensor names and config.json fields live in its module of `model.archs`
(the same tables an export writes with).
"""

from __future__ import annotations

import json
import os
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.model import compressed
from trace_jax.model.archs import Checkpoint, detect_arch, get_arch
from trace_jax.model.config import ModelConfig
from trace_jax.model.transformer import Transformer
from trace_jax.utils.io import read_json_object
from trace_jax.utils.safetensors import DTYPES as _DTYPES

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


def config_from_hf(hf: dict, dtype=jnp.float32) -> ModelConfig:
  """A ModelConfig from a Hugging Face config.json dict (either spelling of each field)."""
  dtype_name = "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"
  return detect_arch(hf).config_from_hf(hf, dtype_name)


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
  arch = get_arch(cfg.arch)
  tensors = compressed.decompress(hf, _read_checkpoint(path))  # FP4 checkpoints: dequantized
  checkpoint = Checkpoint(arch.text_tensors(tensors))  # e.g. Qwen3.5's published layout

  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(state))
  missing_from_map = [p for p in flat if p not in arch.names]
  if missing_from_map:
    raise ValueError(f"no checkpoint mapping for parameters {missing_from_map}")
  for param_path, variable in flat.items():
    expected = variable.get_value().shape
    array = np.asarray(arch.names.read(param_path, expected, checkpoint), dtype=np.float32)
    if array.shape != expected:
      name = ".".join(str(p) for p in param_path)
      raise ValueError(f"tensor for {name} has shape {array.shape}; the config implies {expected}")
    variable.set_value(jnp.asarray(array, dtype))
  unused = sorted(
    n for n in set(checkpoint.tensors) - checkpoint.used if not n.endswith(_IGNORED_SUFFIXES)
  )
  if unused:
    raise ValueError(f"checkpoint tensors that nothing loads (wrong architecture?): {unused[:8]}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))
