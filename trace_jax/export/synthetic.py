"""A synthetic Hugging Face checkpoint of any size, for load and scale checks without a
download: a ModelConfig's tensors under their HF names and layout (the family's name table,
`names`), procedurally generated (seeded by the tensor's name and row), written as bf16
safetensors shards with their index and config.json, in blocks of rows, so neither the
model nor a whole large tensor is ever on the host."""

from __future__ import annotations

import json
import math
import os
import zlib

import ml_dtypes
import numpy as np

from trace_jax.export import names as names_lib
from trace_jax.model.accounting import abstract_variables
from trace_jax.model.config import ModelConfig

BLOCK_BYTES = 16 << 20  # float32 bytes generated at a time (rows of one tensor)


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
  """{HF tensor name: (shape, kind)} of the checkpoint, from the name table (no arrays);
  kind "norm" (a norm's scale) or "weight"."""
  out = {}
  for path, variable in abstract_variables(cfg).items():
    shape = variable.get_value().shape
    kind = "norm" if str(path[-1]) == "scale" else "weight"
    for target in names_lib.targets(cfg, path):
      view = names_lib.hf_array(np.broadcast_to(np.zeros((), np.float32), shape), target)
      out[target.name] = (tuple(view.shape), kind)
  return out


def row_step(shape: tuple[int, ...]) -> int:
  """Rows of a tensor of `shape` generated at a time (about BLOCK_BYTES of float32)."""
  return max(1, BLOCK_BYTES // max(1, math.prod(shape[1:]) * 4))


def synthetic_rows(name: str, shape: tuple[int, ...], kind: str, rows: slice) -> np.ndarray:
  """Rows `rows` (a block that starts at a multiple of `row_step(shape)`) of tensor `name`,
  as bf16: 1 + 0.05 N(0, 1) for a norm's scale, 0.02 N(0, 1) for a weight, drawn from a
  generator seeded by the name and the block's first row."""
  rng = np.random.default_rng([zlib.crc32(name.encode()), rows.start])
  x = rng.standard_normal((rows.stop - rows.start,) + shape[1:], np.float32)
  x = 1.0 + 0.05 * x if kind == "norm" else 0.02 * x
  return x.astype(ml_dtypes.bfloat16)


def synthetic_tensor(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
  """The whole tensor `name` as the checkpoint holds it (every block of rows)."""
  step = row_step(shape)
  blocks = [
    synthetic_rows(name, shape, kind, slice(start, min(shape[0], start + step)))
    for start in range(0, shape[0], step)
  ]
  return np.concatenate(blocks).reshape(shape)


def write_synthetic_checkpoint(directory: str, cfg: ModelConfig, *, max_shard_bytes: int) -> int:
  """Write the checkpoint of `cfg` into `directory`: bf16 shards of at most
  `max_shard_bytes` of tensors (a larger tensor gets one alone), each written under a
  temporary name then renamed, model.safetensors.index.json and config.json
  (`names.hf_config`). Returns its bytes on disk (shards with their headers)."""
  shapes = hf_shapes(cfg)
  shards, current, size = [], [], 0
  for name in sorted(shapes):
    nbytes = math.prod(shapes[name][0]) * 2
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(name)
    size += nbytes
  shards.append(current)
  os.makedirs(directory, exist_ok=True)
  weight_map, total = {}, 0
  for i, names in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
      nbytes = math.prod(shapes[name][0]) * 2
      header[name] = {
        "dtype": "BF16",
        "shape": list(shapes[name][0]),
        "data_offsets": [offset, offset + nbytes],
      }
      offset += nbytes
      weight_map[name] = file
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data aligned to 8 bytes
    with open(os.path.join(directory, file + ".tmp"), "wb") as f:
      f.write(len(blob).to_bytes(8, "little") + blob)
      for name in names:
        shape, kind = shapes[name]
        step = row_step(shape)
        for start in range(0, shape[0], step):
          rows = slice(start, min(shape[0], start + step))
          f.write(synthetic_rows(name, shape, kind, rows).tobytes())
      total += f.tell()
    os.replace(os.path.join(directory, file + ".tmp"), os.path.join(directory, file))
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(names_lib.hf_config(cfg), f)
  return total
