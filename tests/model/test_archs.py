"""One two-way name table per Hugging Face family: what an export writes through it, an
import reads back bit for bit; it names every parameter, each with its own tensors; other
spellings of the same tensors (transformers versions) read the same."""

import json
import pathlib
import shutil

import numpy as np
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.export import names as names_lib
from trace_jax.export.compressed_tensors import write_safetensors
from trace_jax.model import archs, hf
from trace_jax.model.config import ARCHS

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"

# A test-sized model of each family, with every kind of layer it has.
CONFIGS = {
  "qwen3_moe": M.tiny(arch="qwen3_moe", dense_layers=(0,), ffn_dim=64, num_layers=2),
  "mixtral": M.tiny(arch="mixtral", qk_norm="none", num_layers=2),
  "olmoe": M.tiny(arch="olmoe", qk_norm="full", norm_topk_prob=False, tie_embeddings=True),
  "qwen3_5_moe": M.qwen3_5_tiny(),
}


def test_every_family_is_registered_by_its_name():
  assert set(CONFIGS) == set(ARCHS)
  for name in ARCHS:
    assert archs.get_arch(name).name == name
  with pytest.raises(ValueError, match="arch='llama' is not supported"):
    archs.get_arch("llama")


@pytest.mark.parametrize("arch", ARCHS)
def test_table_names_every_parameter_with_its_own_tensors(arch):
  cfg = CONFIGS[arch]
  abstract = nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0)))
  written = []
  for path, var in nnx.to_flat_state(nnx.state(abstract)):
    targets = list(names_lib.targets(cfg, path))
    n_experts = var.get_value().shape[0] if targets[0].expert is not None else 1
    assert len(targets) == n_experts, path
    written += [t.name for t in targets]
  assert len(written) == len(set(written))  # no two parameters write one tensor


@pytest.mark.parametrize("arch", ARCHS)
def test_export_names_read_back_bit_for_bit(arch, tmp_path):
  """Random weights written under the table's names (and `hf_config`) load back as exactly
  the same parameters: one table serves both directions."""
  cfg = CONFIGS[arch]
  policy = M.Transformer(cfg, rngs=nnx.Rngs(11))
  tensors = {}
  for path, var in nnx.to_flat_state(nnx.state(policy)):
    value = np.asarray(var.get_value())
    for target in names_lib.targets(cfg, path):
      tensors[target.name] = np.ascontiguousarray(names_lib.hf_array(value, target))
  write_safetensors(str(tmp_path / "model.safetensors"), tensors)
  (tmp_path / "config.json").write_text(json.dumps(names_lib.hf_config(cfg)))
  loaded = hf.from_hf(str(tmp_path))
  assert loaded.cfg.arch == arch
  for (path, want), (_, got) in zip(
    nnx.to_flat_state(nnx.state(policy)), nnx.to_flat_state(nnx.state(loaded))
  ):
    np.testing.assert_array_equal(got.get_value(), want.get_value(), err_msg=str(path))


def test_mixtral_in_transformers_v5_names_loads_the_same(tmp_path):
  """Mixtral as transformers v5 writes it (`mlp` for `block_sparse_moe`, experts fused in
  `gate_up_proj` [E, 2f, d] / `down_proj` [E, d, f]) loads the same weights as v4's names."""
  path = tmp_path / "mixtral"
  shutil.copytree(FIXTURES / "mixtral", path)
  reference = hf.from_hf(str(path))
  index = json.loads((path / "model.safetensors.index.json").read_text())
  tensors = {}
  for shard in sorted(set(index["weight_map"].values())):
    tensors.update({k: np.array(v) for k, v in hf.read_safetensors(str(path / shard)).items()})
    (path / shard).unlink()
  (path / "model.safetensors.index.json").unlink()
  cfg = reference.cfg
  for layer in range(cfg.num_layers):
    old, new = f"model.layers.{layer}.block_sparse_moe", f"model.layers.{layer}.mlp"
    tensors[f"{new}.gate.weight"] = tensors.pop(f"{old}.gate.weight")
    experts = range(cfg.num_experts)
    w1, w3, w2 = (
      [tensors.pop(f"{old}.experts.{e}.{w}.weight") for e in experts] for w in ("w1", "w3", "w2")
    )
    tensors[f"{new}.experts.gate_up_proj"] = np.stack(
      [np.concatenate([g, u]) for g, u in zip(w1, w3)]
    )
    tensors[f"{new}.experts.down_proj"] = np.stack(w2)
  write_safetensors(str(path / "model.safetensors"), tensors)
  v5 = hf.from_hf(str(path))
  for (p, want), (_, got) in zip(
    nnx.to_flat_state(nnx.state(reference)), nnx.to_flat_state(nnx.state(v5))
  ):
    np.testing.assert_array_equal(got.get_value(), want.get_value(), err_msg=str(p))
