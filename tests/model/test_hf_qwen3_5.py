"""Qwen3.5-MoE import: tiny random checkpoints made with transformers' Qwen3_5MoeForCausalLM
(tests/fixtures/hf/make_qwen3_5_fixtures.py) in both layouts give its logits and experts."""

import functools
import json
import logging
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.model import hf
from trace_jax.model.archs import qwen3_5_moe as hf_qwen3_5

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
LAYOUTS = ["qwen3_5_moe_text", "qwen3_5_moe"]
# float32 tolerance, relative to the logits' spread: transformers' own float32 forward is
# up to 2.4e-4 std away from its float64 forward on these draws (measured), ours 1.7e-4.
RTOL_STD = 3e-4


@functools.lru_cache(maxsize=None)
def _load(layout):
  return hf.from_hf(str(FIXTURES / layout))


@functools.lru_cache(maxsize=None)
def _forward():
  return nnx.jit(lambda m, t: m(t))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_experts_match_transformers(layout):
  model = _load(layout)
  expected = np.load(FIXTURES / layout / "expected.npz")
  assert float(expected["min_router_margin"]) > 1e-4  # top-k is unambiguous in float32
  for seed in range(expected["tokens"].shape[0]):  # three token draws
    aux = _forward()(model, jnp.asarray(expected["tokens"][seed]))
    logits = aux.logits
    reference = expected["logits"][seed]
    np.testing.assert_allclose(logits, reference, rtol=0, atol=RTOL_STD * reference.std())
    np.testing.assert_array_equal(aux.routing, expected["experts"][seed])


@pytest.mark.slow  # two more compilations of the model (~20 s); tests/model/test_deltanet.py
def test_chunk_size_does_not_change_logits():  # covers chunk sizes at the function level

  model = _load("qwen3_5_moe")
  tokens = jnp.asarray(np.load(FIXTURES / "qwen3_5_moe" / "expected.npz")["tokens"][0])
  reference = _forward()(model, tokens).logits  # 24 tokens: one chunk of 64
  graphdef, state = nnx.split(model)
  for chunk in (5,):  # 24 is not a multiple of 5
    other = nnx.merge(graphdef, state)
    for block in other.blocks:
      if block.linear:
        block.attn.chunk_size = chunk
    logits = nnx.jit(lambda m, t: m(t).logits)(other, tokens)
    np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-4 * float(reference.std()))


def test_config_traps_are_read():
  text = _load("qwen3_5_moe_text").cfg
  # layer_types wins over the contradicting full_attention_interval=4 in the same config.
  assert text.layer_types == (
    "linear_attention",
    "full_attention",
    "linear_attention",
    "linear_attention",
    "full_attention",
  )
  assert text.linear_layers == (0, 2, 3) and text.rotary_dim == 8  # factor 0.5 of 16
  assert text.tie_embeddings and text.attn_output_gate and text.zero_centered_norm
  assert (text.linear_num_key_heads, text.linear_num_value_heads) == (2, 4)
  published = _load("qwen3_5_moe").cfg
  # No layer_types: full_attention_interval=2; no partial_rotary_factor: 0.25 of head_dim 32.
  assert published.layer_types == ("linear_attention", "full_attention") * 2
  assert published.rotary_dim == 8 and published.rope_theta == 1e7
  assert not published.tie_embeddings and published.num_experts == 6
  assert published.shared_expert_dim == 16 and published.shared_expert_gate
  # The DeltaNet output norm is plain w (stored around 1), the others 1 + w (around 0).
  block = _load("qwen3_5_moe").blocks[0]
  assert float(jnp.mean(block.attn.norm.scale.get_value())) > 0.5
  assert abs(float(jnp.mean(block.attn_norm.scale.get_value()))) < 0.5


def test_published_layout_skips_mtp_and_vision_by_name_and_reports(caplog):
  with caplog.at_level(logging.WARNING):
    hf.from_hf(str(FIXTURES / "qwen3_5_moe"))
  assert "4 mtp.*" in caplog.text and "3 model.visual.*" in caplog.text


def _edit_shard_of(path, name, edit):
  """Rewrite (float32) the shard that holds tensor `name`, after `edit(tensors)`."""
  index = json.loads((path / "model.safetensors.index.json").read_text())
  shard = path / index["weight_map"][name]
  tensors = {k: np.asarray(v, np.float32) for k, v in hf.read_safetensors(str(shard)).items()}
  edit(tensors)
  header, chunks, offset = {}, [], 0
  for key, array in tensors.items():
    data = np.ascontiguousarray(array).tobytes()
    header[key] = {
      "dtype": "F32",
      "shape": list(array.shape),
      "data_offsets": [offset, offset + len(data)],
    }
    chunks.append(data)
    offset += len(data)
  blob = json.dumps(header).encode()
  shard.write_bytes(len(blob).to_bytes(8, "little") + blob + b"".join(chunks))


def test_other_unknown_tensors_are_still_an_error(tmp_path):
  path = tmp_path / "q"
  shutil.copytree(FIXTURES / "qwen3_5_moe", path)
  name = "model.language_model.layers.0.linear_attn.A_log"
  _edit_shard_of(
    path,
    name,
    lambda t: t.update(
      {"model.language_model.layers.0.linear_attn.extra.weight": np.ones(3, np.float32)}
    ),
  )
  with pytest.raises(ValueError, match="nothing loads.*linear_attn.extra"):
    hf.from_hf(str(path))


def test_missing_deltanet_tensor_is_named(tmp_path):
  path = tmp_path / "q"
  shutil.copytree(FIXTURES / "qwen3_5_moe", path)
  name = "model.language_model.layers.0.linear_attn.A_log"
  _edit_shard_of(path, name, lambda t: t.pop(name))
  with pytest.raises(ValueError, match="missing tensor 'model.layers.0.linear_attn.A_log'"):
    hf.from_hf(str(path))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
  "option, value, allowed",
  [
    ("hidden_act", "gelu", r"\['silu', 'swish'\]"),
    ("attention_bias", True, r"\[False\]"),
    ("mlp_bias", True, r"\[False\]"),
  ],
)
def test_options_it_does_not_compute_are_refused_by_name(tmp_path, layout, option, value, allowed):
  """As for the other architectures (tests/reliability/test_input_refusals.py): an option
  this implementation would silently compute otherwise is refused, naming the field, in
  either layout (the published one nests it under text_config)."""
  config = json.loads((FIXTURES / layout / "config.json").read_text())
  hf.config_from_hf(config)  # as written: accepted
  hf_qwen3_5.text_config(config)[option] = value
  path = tmp_path / "q"
  path.mkdir()
  (path / "config.json").write_text(json.dumps(config))  # refused before any weight is read
  with pytest.raises(
    ValueError, match=rf"config.json: {option}={value!r} is not supported; supported: {allowed}"
  ):
    hf.from_hf(str(path))
