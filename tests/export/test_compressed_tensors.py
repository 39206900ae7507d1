"""The compressed-tensors export: file format by the spec (an independent NumPy decoder),
the rollout's bytes exactly, names and config per architecture, and the round trip."""

import json
import os

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from tests.fp4 import reference
from trace_jax import fp4
from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.export import export_compressed_tensors, hf_config, tensor_listing
from trace_jax.export.load import load_fp4
from trace_jax.model.hf import _read_checkpoint

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)  # OCP MX v1.0 table


def read_by_spec(directory):
  """Every tensor of a safetensors checkpoint, parsed from the bytes with NumPy alone."""
  codes = {
    "U8": np.uint8,
    "F32": np.float32,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
  }
  out = {}
  for name in os.listdir(directory):
    if name.endswith(".safetensors"):
      blob = open(os.path.join(directory, name), "rb").read()
      n = int.from_bytes(blob[:8], "little")
      header = json.loads(blob[8 : 8 + n])
      for key, info in header.items():
        if key != "__metadata__":
          start, end = info["data_offsets"]
          out[key] = np.frombuffer(blob[8 + n + start : 8 + n + end], codes[info["dtype"]]).reshape(
            info["shape"]
          )
  return out


def decode_nvfp4(tensors, module):
  """x = e2m1(code) * (scale / global_scale), codes two per byte, element 2i low nibble."""
  packed = tensors[f"{module}.weight_packed"]
  nibbles = np.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
  values = np.where(nibbles & 8, -1.0, 1.0).astype(np.float32) * E2M1[nibbles & 7]
  scale = (
    tensors[f"{module}.weight_scale"].astype(np.float32)
    / tensors[f"{module}.weight_global_scale"][0]
  )
  return values * np.repeat(scale, 16, axis=-1), nibbles


@pytest.fixture(scope="module")
def tiny_policy():
  return M.Transformer(M.tiny(), rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def tiny_export(tiny_policy, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("tiny_nvfp4"))
  export_compressed_tensors(tiny_policy, out)
  return out


def test_files_follow_the_format(tiny_policy, tiny_export):
  cfg = tiny_policy.cfg
  rows = {name: (dtype, shape) for name, dtype, shape in tensor_listing(tiny_export)}
  q = "model.layers.1.self_attn.q_proj"
  assert rows[f"{q}.weight_packed"] == ("U8", (cfg.num_heads * cfg.head_dim, cfg.d_model // 2))
  assert rows[f"{q}.weight_scale"] == ("F8_E4M3", (cfg.num_heads * cfg.head_dim, cfg.d_model // 16))
  assert rows[f"{q}.weight_global_scale"] == ("F32", (1,))
  down = "model.layers.0.mlp.experts.3.down_proj"
  assert rows[f"{down}.weight_packed"] == ("U8", (cfg.d_model, cfg.moe_ffn_dim // 2))
  for name in (
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.0.mlp.gate.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_norm.weight",
  ):
    assert rows[name][0] == "BF16", name
  assert not any(n.endswith("input_global_scale") for n in rows)  # weight-only by default
  linears = {n.rsplit(".", 1)[0] for n in rows if n.endswith("weight_packed")}
  assert len(linears) == cfg.num_layers * (4 + 3 * cfg.num_experts)
  hf = json.load(open(os.path.join(tiny_export, "config.json")))
  qc = hf["quantization_config"]
  assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
  weights = qc["config_groups"]["group_0"]["weights"]
  assert (weights["num_bits"], weights["type"], weights["strategy"], weights["group_size"]) == (
    4,
    "float",
    "tensor_group",
    16,
  )
  assert qc["config_groups"]["group_0"]["input_activations"] is None
  assert sorted(qc["ignore"]) == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
  assert M.hf.config_from_hf(hf) == cfg.replace(name=M.hf.config_from_hf(hf).name)


def test_spec_decoder_gives_the_training_path_weights_and_the_reference_codes(
  tiny_policy, tiny_export
):
  """The bytes decode (by the spec, NumPy only) to the weights the trainer fake-quantizes,
  and their codes are the independent reference's for one shared global scale."""
  tensors = read_by_spec(tiny_export)
  sq = M.SiteQuantizer(M.QuantConfig(), 2, jnp.float32)
  attn = tiny_policy.blocks[1].attn
  masters = [attn.q_proj.get_value(), attn.k_proj.get_value(), attn.v_proj.get_value()]
  trained = sq.weight_group(masters, "attention")
  mods = [f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
  decoded = [decode_nvfp4(tensors, m) for m in mods]
  for (values, _), train in zip(decoded, trained):
    np.testing.assert_array_equal(values, np.asarray(train).T)
  gs = {float(tensors[f"{m}.weight_global_scale"][0]) for m in mods}
  assert len(gs) == 1  # q, k, v share one global scale
  joint = np.concatenate([np.asarray(w).T for w in masters], axis=0)  # [out, in], fused qkv
  codes, scale_bits, ref_gs = reference.nvfp4(joint)
  np.testing.assert_array_equal(np.concatenate([c for _, c in decoded]), codes)
  np.testing.assert_array_equal(
    np.concatenate([tensors[f"{m}.weight_scale"].view(np.uint8) for m in mods]), scale_bits
  )
  assert gs == {float(ref_gs.reshape(()))}
  # Gate and up of one expert share one global scale; experts have their own.
  moe = tiny_policy.blocks[0].moe
  prefix = "model.layers.0.mlp.experts"
  for e in range(tiny_policy.cfg.num_experts):
    joint = np.concatenate(
      [np.asarray(moe.w_gate.get_value()[e]).T, np.asarray(moe.w_up.get_value()[e]).T], axis=0
    )
    codes, _, ref_gs = reference.nvfp4(joint)
    got = np.concatenate(
      [decode_nvfp4(tensors, f"{prefix}.{e}.{p}")[1] for p in ("gate_proj", "up_proj")]
    )
    np.testing.assert_array_equal(got, codes)
    for p in ("gate_proj", "up_proj"):
      assert tensors[f"{prefix}.{e}.{p}.weight_global_scale"][0] == ref_gs.reshape(())


def _packed_equal(a_state, b_state):
  a, b = dict(nnx.to_flat_state(a_state)), dict(nnx.to_flat_state(b_state))
  assert a.keys() == b.keys()
  count = 0
  for key in a:
    va, vb = a[key].get_value(), b[key].get_value()
    if isinstance(va, fp4.QArray):
      assert isinstance(vb, fp4.QArray), key
      chex.assert_trees_all_equal(va, vb)
      count += 1
  return count


def test_round_trip_keeps_the_rollout_bytes_and_logits(tiny_policy, tiny_export):
  quant = M.QuantConfig()
  loaded = load_fp4(tiny_export)
  assert (
    _packed_equal(
      R.quantize_params(nnx.state(tiny_policy), quant), R.quantize_params(nnx.state(loaded), quant)
    )
    == 14
  )
  # The exported policy: the packed weights, everything else rounded to bf16.
  exported = nnx.merge(*nnx.split(tiny_policy))
  for path, var in nnx.to_flat_state(nnx.state(exported)):
    if not M.is_quantized_weight(var):
      var.set_value(var.get_value().astype(jnp.bfloat16).astype(jnp.float32))
  config = R.RolloutConfig(
    precision="fp4",
    compute_dtype="float32",
    guidance="none",
    max_len=24,
    prompt_bucket=8,
    sampling=R.SamplingConfig(temperature=1.0, max_new_tokens=6),
  )
  prompts = [[5, 17, 3], [9, 2, 44, 7]]
  want = R.RolloutEngine(exported, config).generate(prompts, jax.random.key(4))
  got = R.RolloutEngine(loaded, config).generate(prompts, jax.random.key(4))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.logprobs, want.logprobs)
  # from_hf dequantizes the same checkpoint into master weights that are the FP4 values.
  master = M.from_hf(tiny_export)
  for (path, a), (_, b) in zip(
    nnx.to_flat_state(nnx.state(master)), nnx.to_flat_state(nnx.state(loaded))
  ):
    value = b.get_value()
    want_value = fp4.dequantize(value) if isinstance(value, fp4.QArray) else value
    np.testing.assert_array_equal(a.get_value(), want_value, err_msg=str(path))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_each_architecture_exports_under_its_own_names(arch, tmp_path):
  source = os.path.join(FIXTURES, arch)
  policy = M.from_hf(source)
  out = str(tmp_path / arch)
  export_compressed_tensors(policy, out, source=source)
  theirs = set(_read_checkpoint(source))
  ours = {name for name, _, _ in tensor_listing(out)}
  quantized = {n[: -len(".weight_packed")] for n in ours if n.endswith(".weight_packed")}
  expected = set()
  for name in theirs:
    module = name[: -len(".weight")]
    if module in quantized:
      expected |= {
        f"{module}.{f}" for f in ("weight_packed", "weight_scale", "weight_global_scale")
      }
    else:
      expected.add(name)
  assert ours == expected
  assert any(".experts.0." in m for m in quantized) and any("self_attn" in m for m in quantized)
  src_config = json.load(open(os.path.join(source, "config.json")))
  out_config = json.load(open(os.path.join(out, "config.json")))
  assert {k: v for k, v in out_config.items() if k != "quantization_config"} == src_config
  assert os.path.exists(os.path.join(out, "generation_config.json"))
  assert (
    _packed_equal(
      R.quantize_params(nnx.state(policy), M.QuantConfig()),
      R.quantize_params(nnx.state(load_fp4(out)), M.QuantConfig()),
    )
    > 0
  )


def test_mxfp4_export_and_shards(tiny_policy, tmp_path):
  out = str(tmp_path / "mx")
  info = export_compressed_tensors(tiny_policy, out, fmt="mxfp4", max_shard_bytes=20_000)
  assert len(info["files"]) > 1 and os.path.exists(
    os.path.join(out, "model.safetensors.index.json")
  )
  index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
  rows = {name: (dtype, shape) for name, dtype, shape in tensor_listing(out)}
  assert set(index["weight_map"]) == set(rows)
  cfg = tiny_policy.cfg
  up = "model.layers.0.mlp.experts.1.up_proj"
  assert rows[f"{up}.weight_scale"] == ("U8", (cfg.moe_ffn_dim, cfg.d_model // 32))
  assert f"{up}.weight_global_scale" not in rows
  qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
  assert qc["format"] == "mxfp4-pack-quantized"
  quant = M.QuantConfig(fmt="mxfp4")
  assert (
    _packed_equal(
      R.quantize_params(nnx.state(tiny_policy), quant),
      R.quantize_params(nnx.state(load_fp4(out)), quant),
    )
    == 14
  )


def test_config_made_from_a_preset_reads_back_and_bad_input_is_refused(tiny_policy, tmp_path):
  for cfg in (M.tiny(), M.qwen3_30b_a3b(), M.mixtral_8x7b(), M.olmoe_1b_7b()):
    back = M.hf.config_from_hf(hf_config(cfg))
    assert back.replace(name=cfg.name, dtype=cfg.dtype, ffn_dim=cfg.ffn_dim) == cfg
  with pytest.raises(ValueError, match="shared_expert_dim"):
    hf_config(M.tiny(shared_expert_dim=32))
  with pytest.raises(ValueError, match="fmt"):
    export_compressed_tensors(tiny_policy, str(tmp_path), fmt="int4")
  with pytest.raises(ValueError, match="activations"):
    export_compressed_tensors(tiny_policy, str(tmp_path), fmt="mxfp4", activations="nvfp4")
  with pytest.raises(ValueError, match="input_scales"):
    export_compressed_tensors(tiny_policy, str(tmp_path), activations="nvfp4")
  broken = nnx.clone(tiny_policy)  # a copy: the module's policy stays finite
  broken.blocks[0].attn.o_proj.set_value(
    broken.blocks[0].attn.o_proj.get_value().at[0, 0].set(jnp.nan)
  )
  with pytest.raises(ValueError, match="NaN"):
    export_compressed_tensors(broken, str(tmp_path))
  assert not os.listdir(tmp_path)  # refused before writing anything


def test_experts_kv_scope_exports_attention_in_bf16(tiny_policy, tmp_path):
  quant = M.QuantConfig(sites="experts+kv")
  out = str(tmp_path / "experts_kv")
  export_compressed_tensors(tiny_policy, out, quant=quant)
  rows = {name: (dtype, shape) for name, dtype, shape in tensor_listing(out)}
  cfg = tiny_policy.cfg
  assert rows["model.layers.0.self_attn.q_proj.weight"] == (
    "BF16",
    (cfg.num_heads * cfg.head_dim, cfg.d_model),
  )
  assert "model.layers.0.self_attn.q_proj.weight_packed" not in rows
  assert rows["model.layers.0.mlp.experts.2.up_proj.weight_packed"][0] == "U8"
  ignore = json.load(open(os.path.join(out, "config.json")))["quantization_config"]["ignore"]
  assert {f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} <= set(
    ignore
  )
  assert (
    _packed_equal(
      R.quantize_params(nnx.state(tiny_policy), quant),
      R.quantize_params(nnx.state(load_fp4(out)), quant),
    )
    == 6
  )


def _pattern(name: str) -> str:
  """A tensor name with layer and expert numbers replaced by N, quantization suffixes by
  `weight`: what an architecture's naming scheme looks like, independent of its sizes."""
  for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
    if name.endswith("." + suffix):
      name = name[: -len(suffix)] + "weight"
  return ".".join("N" if part.isdigit() else part for part in name.split("."))


def test_qwen3_5_checkpoint_exports_under_the_names_transformers_wrote(tmp_path):
  """The Qwen3.5-MoE fixture (written by transformers' Qwen3_5MoeForCausalLM) exports with
  its own names, config and every tensor; in the method's scope (routed experts FP4) its
  24-wide shared expert, which 16-element blocks cannot split, stays bf16."""
  source = os.path.join(FIXTURES, "qwen3_5_moe_text")
  policy = M.from_hf(source)
  out = str(tmp_path / "qwen3_5")
  quant = M.QuantConfig(sites="experts+kv")
  export_compressed_tensors(policy, out, source=source, quant=quant)
  theirs = set(_read_checkpoint(source))
  ours = {name for name, _, _ in tensor_listing(out)}
  quantized = {n[: -len(".weight_packed")] for n in ours if n.endswith(".weight_packed")}
  assert quantized and all(".mlp.experts." in m for m in quantized)
  expected = {n for n in theirs if n[: -len(".weight")] not in quantized}
  expected |= {
    f"{m}.{f}" for m in quantized for f in ("weight_packed", "weight_scale", "weight_global_scale")
  }
  assert ours == expected
  src_config = json.load(open(os.path.join(source, "config.json")))
  out_config = json.load(open(os.path.join(out, "config.json")))
  assert {k: v for k, v in out_config.items() if k != "quantization_config"} == src_config
  # The Gated DeltaNet tensors (conv1d [C, 1, K], A_log, dt_bias, norm) are the source's.
  spec = read_by_spec(out)
  source_tensors = _read_checkpoint(source)
  for name in (
    "model.layers.0.linear_attn.conv1d.weight",
    "model.layers.0.linear_attn.A_log",
    "model.layers.2.linear_attn.norm.weight",
    "model.layers.3.linear_attn.dt_bias",
  ):
    np.testing.assert_array_equal(spec[name], source_tensors[name], err_msg=name)
  assert (
    _packed_equal(
      R.quantize_params(nnx.state(policy), quant),
      R.quantize_params(nnx.state(load_fp4(out)), quant),
    )
    == 15
  )  # 5 layers x 3


@pytest.mark.slow
def test_qwen3_5_tiny_policy_round_trip_with_every_linear_in_fp4(tmp_path):
  """A qwen3_5_tiny policy (no source checkpoint: config.json made from the preset) in the
  full scope: Gated DeltaNet, gated attention and shared-expert linears in FP4 under the
  names transformers uses; it loads back with the same bytes and the same FP4 logits.
  (Slow: two forwards of the hybrid model; `pytest -m slow tests/export`. The default suite
  keeps the fixture's names and bytes round trip above.)"""
  policy = M.Transformer(M.get_preset("qwen3_5_tiny"), rngs=nnx.Rngs(5))
  out = str(tmp_path / "qwen3_5_tiny")
  export_compressed_tensors(policy, out)
  config = json.load(open(os.path.join(out, "config.json")))
  assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
  assert config["model_type"] == "qwen3_5_moe_text"
  back = M.hf.config_from_hf(config)
  assert (
    back.replace(
      name=policy.cfg.name, dtype=policy.cfg.dtype, delta_chunk_size=policy.cfg.delta_chunk_size
    )
    == policy.cfg
  )
  ours = {_pattern(name) for name, _, _ in tensor_listing(out)}
  transformers_names = {
    _pattern(n) for n in _read_checkpoint(os.path.join(FIXTURES, "qwen3_5_moe_text"))
  }
  assert ours - {"lm_head.weight"} == transformers_names  # the preset does not tie embeddings
  rows = {name: (dtype, shape) for name, dtype, shape in tensor_listing(out)}
  for module in (
    "model.layers.0.linear_attn.in_proj_qkv",
    "model.layers.0.linear_attn.out_proj",
    "model.layers.3.self_attn.q_proj",
    "model.layers.1.mlp.shared_expert.down_proj",
  ):
    assert rows[f"{module}.weight_packed"][0] == "U8", module
  loaded = load_fp4(out)
  quant = M.QuantConfig()
  assert (
    _packed_equal(
      R.quantize_params(nnx.state(policy), quant), R.quantize_params(nnx.state(loaded), quant)
    )
    > 0
  )
  exported = nnx.merge(*nnx.split(policy))  # the packed weights, everything else in bf16
  for path, var in nnx.to_flat_state(nnx.state(exported)):
    if not M.is_quantized_weight(var):
      var.set_value(var.get_value().astype(jnp.bfloat16).astype(jnp.float32))
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, policy.cfg.vocab_size)
  want = exported(tokens, quant=quant).logits
  got = loaded(tokens, quant=quant).logits
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
