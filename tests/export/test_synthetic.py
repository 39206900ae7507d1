"""The synthetic checkpoint (trace_jax/export/synthetic.py): in shards of the size asked for,
with an index that names every tensor, it loads through `from_hf` (which refuses a missing,
misshapen or unused tensor) into the ModelConfig it was written from, every tensor holding
the values `synthetic_tensor` gives (generated in several blocks of rows here), drawn with
the stated scales."""

import json
import math
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import model as M
from trace_jax.export import names as names_lib
from trace_jax.export import synthetic
from trace_jax.model import accounting, hf


def _tensor_bytes(file: str) -> dict[str, int]:
  """{name: bytes} of a safetensors file's tensors, from its header."""
  with open(file, "rb") as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  header.pop("__metadata__", None)
  return {
    name: end - start for name, (start, end) in ((n, t["data_offsets"]) for n, t in header.items())
  }


def test_a_synthetic_checkpoint_loads_with_its_values(tmp_path, monkeypatch):
  monkeypatch.setattr(synthetic, "BLOCK_BYTES", 4096)  # several blocks of rows per tensor
  cfg = M.tiny(arch="qwen3_moe", dense_layers=(0,), ffn_dim=64, num_layers=2)
  shapes = synthetic.hf_shapes(cfg)
  limit = 40_000
  total = synthetic.write_synthetic_checkpoint(str(tmp_path), cfg, max_shard_bytes=limit)

  files = hf.shard_files(str(tmp_path))
  assert len(files) > 1 and total == sum(os.path.getsize(f) for f in files)
  with open(tmp_path / "model.safetensors.index.json") as f:
    assert set(json.load(f)["weight_map"]) == set(shapes)
  for file in files:  # at most `limit` bytes of tensors, or one larger tensor alone
    held = _tensor_bytes(file)
    assert sum(held.values()) <= limit or len(held) == 1, (file, held)
  assert sum(math.prod(shape) for shape, _ in shapes.values()) == accounting.param_count(cfg)
  assert any(shape[0] > synthetic.row_step(shape) for shape, _ in shapes.values())

  policy = hf.from_hf(str(tmp_path), jnp.bfloat16)
  assert policy.cfg.replace(name=cfg.name, dtype=cfg.dtype) == cfg
  seen = set()
  for path, variable in nnx.to_flat_state(nnx.state(policy)):
    value = np.asarray(variable.get_value())
    for target in names_lib.targets(cfg, path):
      want = synthetic.synthetic_tensor(target.name, *shapes[target.name])
      np.testing.assert_array_equal(names_lib.hf_array(value, target), want, err_msg=target.name)
      seen.add(target.name)
  assert seen == set(shapes)

  embedding = synthetic.synthetic_tensor(
    "model.embed_tokens.weight", *shapes["model.embed_tokens.weight"]
  ).astype(np.float32)
  assert abs(embedding.mean()) < 2e-3 and abs(embedding.std() - 0.02) < 2e-3
  norm = synthetic.synthetic_tensor("model.norm.weight", *shapes["model.norm.weight"])
  assert abs(norm.astype(np.float32).mean() - 1) < 0.03
