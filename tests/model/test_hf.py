"""Hugging Face import: tiny random checkpoints made with transformers (see
tests/fixtures/hf/make_fixtures.py) load and give the reference logits and experts."""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.model import hf

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
ARCHS = ["qwen3_moe", "mixtral", "olmoe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_matches_reference_logits_and_experts(arch):
  model = hf.from_hf(str(FIXTURES / arch))
  expected = np.load(FIXTURES / arch / "expected.npz")
  aux = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(expected["tokens"]))
  logits = aux.logits
  tolerance = 1e-4 * expected["logits"].std()
  np.testing.assert_allclose(logits, expected["logits"], rtol=0, atol=tolerance)
  np.testing.assert_array_equal(aux.routing, expected["experts"])


def test_config_features_are_read():
  qwen = hf.from_hf(str(FIXTURES / "qwen3_moe")).cfg
  assert qwen.dense_layers == (1,) and qwen.qk_norm == "head" and qwen.norm_topk_prob
  assert qwen.rope_theta == 1e6 and qwen.num_experts == 4  # rope_parameters, num_experts
  mixtral = hf.from_hf(str(FIXTURES / "mixtral")).cfg  # sharded; top-level rope_theta
  assert mixtral.rope_theta == 1e6 and mixtral.num_experts == 4 and mixtral.qk_norm == "none"
  olmoe = hf.from_hf(str(FIXTURES / "olmoe")).cfg
  assert olmoe.tie_embeddings and not olmoe.norm_topk_prob and olmoe.qk_norm == "full"


def test_both_spellings_of_config_fields():
  base = json.loads((FIXTURES / "mixtral" / "config.json").read_text())
  new_style = dict(base)
  new_style["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
  del new_style["rope_theta"]
  new_style["num_experts"] = new_style.pop("num_local_experts")
  cfg = hf.config_from_hf(new_style)
  assert cfg.rope_theta == 5e5 and cfg.num_experts == 4
  scaled = dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(ValueError, match="rope"):
    hf.config_from_hf(scaled)


def test_bfloat16_load():
  model = hf.from_hf(str(FIXTURES / "olmoe"), dtype=jnp.bfloat16)
  assert model.cfg.dtype == "bfloat16"
  assert model.embed.get_value().dtype == jnp.bfloat16


def _copy(arch, tmp_path):
  dst = tmp_path / arch
  shutil.copytree(FIXTURES / arch, dst)
  return dst


def test_unknown_architecture_lists_supported(tmp_path):
  path = _copy("olmoe", tmp_path)
  config = json.loads((path / "config.json").read_text())
  config.update(model_type="llama", architectures=["LlamaForCausalLM"])
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="model_type='llama'.*qwen3_moe.*mixtral.*olmoe"):
    hf.from_hf(str(path))


def _rewrite(path, edit):
  tensors = {
    k: np.array(v) for k, v in hf.read_safetensors(str(path / "model.safetensors")).items()
  }
  edit(tensors)
  _write_safetensors(path / "model.safetensors", tensors)


def _write_safetensors(path, tensors):
  header, chunks, offset = {}, [], 0
  for name, array in tensors.items():
    data = np.ascontiguousarray(array, np.float32).tobytes()
    header[name] = {
      "dtype": "F32",
      "shape": list(array.shape),
      "data_offsets": [offset, offset + len(data)],
    }
    chunks.append(data)
    offset += len(data)
  blob = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(len(blob).to_bytes(8, "little") + blob + b"".join(chunks))


def test_missing_tensor_is_named(tmp_path):
  path = _copy("olmoe", tmp_path)
  _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
  with pytest.raises(ValueError, match="missing tensor 'model.layers.1.self_attn.k_proj.weight'"):
    hf.from_hf(str(path))


def test_misshapen_tensor_is_named(tmp_path):
  path = _copy("olmoe", tmp_path)

  def shrink(t):
    t["model.layers.0.mlp.experts.2.up_proj.weight"] = t[
      "model.layers.0.mlp.experts.2.up_proj.weight"
    ][:8]

  _rewrite(path, shrink)
  with pytest.raises(ValueError, match="experts"):
    hf.from_hf(str(path))
  path2 = _copy("qwen3_moe", tmp_path / "q")
  _rewrite(path2, lambda t: t.update({"model.norm.weight": np.ones(7, np.float32)}))
  with pytest.raises(ValueError, match="final_norm.scale has shape"):
    hf.from_hf(str(path2))


def test_fused_expert_layout_loads_the_same(tmp_path):
  path = _copy("olmoe", tmp_path)
  reference = hf.from_hf(str(path))

  def fuse(t):
    for layer in range(3):
      p = f"model.layers.{layer}.mlp.experts"
      gates = [t.pop(f"{p}.{e}.gate_proj.weight") for e in range(4)]
      ups = [t.pop(f"{p}.{e}.up_proj.weight") for e in range(4)]
      downs = [t.pop(f"{p}.{e}.down_proj.weight") for e in range(4)]
      t[f"{p}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gates, ups)])
      t[f"{p}.down_proj"] = np.stack(downs)

  _rewrite(path, fuse)
  fused = hf.from_hf(str(path))
  for name in ("w_gate", "w_up", "w_down"):
    np.testing.assert_array_equal(
      getattr(fused.blocks[2].moe, name).get_value(),
      getattr(reference.blocks[2].moe, name).get_value(),
    )


def test_unused_tensors_are_an_error(tmp_path):
  path = _copy("olmoe", tmp_path)
  _rewrite(
    path, lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": np.ones(3, np.float32)})
  )
  with pytest.raises(ValueError, match="nothing loads.*shared_expert"):
    hf.from_hf(str(path))


def _lie(path, **fields):
  config = json.loads((path / "config.json").read_text())
  text = config.get("text_config", config)
  text.update(fields)
  (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
  "arch, fields, match",
  [
    # 10000 claimed layers used to keep the abstract model's construction busy for minutes.
    ("olmoe", {"num_hidden_layers": 10000}, r"num_hidden_layers=10000 but the files hold 3 "),
    ("olmoe", {"num_hidden_layers": 2}, r"num_hidden_layers=2 but the files hold 3 \(model"),
    ("mixtral", {"num_local_experts": 4000}, r"num_local_experts=4000 but the files hold 4 exp"),
    ("olmoe", {"num_experts": 3}, r"num_experts=3 but the files hold 4 experts"),
    ("olmoe", {"hidden_size": 48}, r"hidden_size=48 but model.embed_tokens.weight is \[96, 32\]"),
    ("qwen3_moe", {"vocab_size": 97}, r"vocab_size=97 but model.embed_tokens.weight is \[96, 32"),
    (
      "qwen3_5_moe",  # the published layout: nested config, fused experts, renamed layers
      {"num_hidden_layers": 10000, "num_experts": 7},
      r"text_config.num_hidden_layers=10000 but the files hold 4 \(model.layers.0 to 3\); "
      r"text_config.num_experts=7 but the files hold 6 experts",
    ),
  ],
)
def test_a_config_the_tensors_contradict_is_refused_before_anything_is_built(
  tmp_path, monkeypatch, arch, fields, match
):
  path = _copy(arch, tmp_path)
  _lie(path, **fields)

  def never(*args, **kwargs):
    raise AssertionError("the model was built before the config was checked")

  monkeypatch.setattr(nnx, "eval_shape", never)
  with pytest.raises(ValueError, match=rf"^{path / 'config.json'}: " + match):
    hf.from_hf(str(path))


def _relabel(file, name, dtype, shape=None):
  """Rewrite one header entry's dtype (and shape) over the same bytes."""
  raw = file.read_bytes()
  size = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8 : 8 + size])
  header[name]["dtype"] = dtype
  header[name]["shape"] = shape or header[name]["shape"]
  blob = json.dumps(header).encode()
  file.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + size :])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_weight_is_refused_naming_the_tensor(tmp_path, bad):
  path = _copy("olmoe", tmp_path)
  rng = np.random.default_rng(0)
  poisoned = "model.layers.1.mlp.experts.2.down_proj.weight"

  def poison(t):
    array = t[poisoned]
    array[tuple(int(rng.integers(0, n)) for n in array.shape)] = bad

  _rewrite(path, poison)
  with pytest.raises(
    ValueError,
    match=rf"^tensor '{poisoned}' in {path / 'model.safetensors'} holds 1 NaN or Inf values "
    r"\(read as blocks.1.moe.w_down\): non-finite weights are refused",
  ):
    hf.from_hf(str(path))
  loaded = hf.from_hf(str(path), allow_nonfinite=True)  # for debugging, as it is
  assert np.count_nonzero(~np.isfinite(loaded.blocks[1].moe.w_down.get_value())) == 1


@pytest.mark.parametrize("dtype, shape", [("I32", None), ("U8", [96, 128]), ("BOOL", [96, 128])])
def test_a_weight_labelled_as_integers_is_refused(tmp_path, dtype, shape):
  # The bytes are the F32 lm_head's; an integer label used to load them as integers.
  path = _copy("qwen3_moe", tmp_path)
  _relabel(path / "model.safetensors", "lm_head.weight", dtype, shape)
  with pytest.raises(
    ValueError,
    match=rf"^{path / 'model.safetensors'}: tensor 'lm_head.weight' has dtype {dtype}; a "
    r"weight must be stored as one of \['F64', 'F32', 'F16', 'BF16', 'F8_E4M3'\]",
  ):
    hf.from_hf(str(path))
