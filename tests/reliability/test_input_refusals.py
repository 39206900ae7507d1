"""Inputs that used to be accepted silently or failed deep inside: each
is refused with a ValueError naming the value (or the file) and what is allowed."""

import json
import pathlib
import random
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as G
from trace_jax.model import hf
from trace_jax.model.config import tiny
from trace_jax.model.transformer import Transformer
from trace_jax.rl.config import RLConfig
from trace_jax.rl.grpo import LossConfig
from trace_jax.run.policy_source import check, preflight
from trace_jax.utils.io import resolve_inside
from trace_jax.rollout.config import RolloutConfig, SamplingConfig
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.tasks.registry import get_task
from trace_jax.training.forward import training_forward

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"


@pytest.fixture(scope="module")
def model():
  return Transformer(tiny(), rngs=nnx.Rngs(0))


def _tokens(seed, bad_value, shape=(2, 9)):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 128, shape)
  where = tuple(int(rng.integers(0, n)) for n in shape)
  tokens[where] = bad_value
  return jnp.asarray(tokens, jnp.int32), where


@pytest.mark.parametrize("bad", [128, 1000, -1, -128])
def test_token_ids_outside_the_vocabulary_are_refused(model, bad):
  tokens, where = _tokens(abs(bad), bad)
  message = re.escape(f"token ids [{bad}] outside the vocabulary [0, 128) (first at index {where})")
  with pytest.raises(ValueError, match=r"^tokens hold " + message):
    model(tokens)
  with pytest.raises(ValueError, match=r"^training_forward tokens hold " + message):
    training_forward(model, tokens, None, jnp.ones(tokens.shape, bool), quant=None)
  engine = RolloutEngine(
    model, RolloutConfig(max_len=32, sampling=SamplingConfig(max_new_tokens=2))
  )
  with pytest.raises(ValueError, match=rf"prompts\[{where[0]}\] holds token ids \[{bad}\]"):
    engine.generate(np.asarray(tokens).tolist(), jax.random.key(0))


def test_under_jit_a_bad_id_is_nan_never_another_token(model):
  # Traced ids cannot be read; a negative id used to wrap around to a real token (finite,
  # wrong logits). Now its embedding row is NaN, so the fault shows.
  tokens, where = _tokens(3, -1)
  logits = nnx.jit(lambda m, t: m(t).logits)(model, tokens)
  assert np.isnan(np.asarray(logits)[where]).all()
  good = tokens.at[where].set(5)
  assert np.isfinite(np.asarray(nnx.jit(lambda m, t: m(t).logits)(model, good))).all()


def _hf_copy(tmp_path, edit=None):
  path = tmp_path / "ckpt"
  shutil.copytree(FIXTURES / "qwen3_moe", path)
  if edit is not None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
  return path


@pytest.mark.parametrize(
  "option, value, allowed",
  [
    ("hidden_act", "gelu", r"\['silu', 'swish'\]"),
    ("attention_bias", True, r"\[False\]"),
    ("mlp_bias", True, r"\[False\]"),
    ("partial_rotary_factor", 0.5, r"\[1, 1.0\]"),
  ],
)
def test_from_hf_refuses_options_it_does_not_compute(tmp_path, option, value, allowed):
  path = _hf_copy(tmp_path, lambda c: c.update({option: value}))
  with pytest.raises(
    ValueError,
    match=rf"config.json: {option}={value!r} is not supported; "
    rf"supported: {allowed}",
  ):
    hf.from_hf(str(path))


def test_from_hf_names_the_bad_file(tmp_path):
  path = _hf_copy(tmp_path)
  config_path = path / "config.json"
  good = config_path.read_text()
  config_path.write_text(good[: len(good) // 2])
  with pytest.raises(ValueError, match=rf"{config_path} is not valid JSON"):
    hf.from_hf(str(path))
  config = json.loads(good)
  del config["hidden_size"]
  config_path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match=rf"{config_path} lacks the required field 'hidden_size'"):
    hf.from_hf(str(path))
  config_path.write_text(good)
  weights = path / "model.safetensors"
  data = weights.read_bytes()
  weights.write_bytes(data[: len(data) * 2 // 3])  # a download cut short
  with pytest.raises(
    ValueError,
    match=rf"{weights}: tensor '.*' .* has data offsets .* "
    rf"\(truncated or damaged file\)",
  ):
    hf.from_hf(str(path))
  weights.write_bytes(data[:4])
  with pytest.raises(ValueError, match=rf"{weights}: not a safetensors file \(4 bytes"):
    hf.from_hf(str(path))


def _small_guidance():
  key = jax.random.key(7)
  records = {
    (1, site): fp4.quantize(
      jax.random.normal(jax.random.fold_in(key, i), (1, 2, 32)), global_group="row"
    )
    for i, site in enumerate(("attn_in", "moe_in"))
  }
  routing = jax.random.randint(key, (2, 1, 2, 2), 0, 4).astype(jnp.int8)
  return G.Guidance(
    sites=G.from_records(records, "compact", (1,)), routing=routing, mode="compact", layers=(1,)
  ).to_host()


def test_damaged_guidance_file_never_loads_silently(tmp_path):
  guidance = _small_guidance()
  path = tmp_path / "guidance.npz"
  guidance.save(str(path))
  original = path.read_bytes()
  rng = random.Random(0)
  flips = rng.sample(range(len(original) * 8), 600)
  refused = 0
  for bit in flips:
    damaged = bytearray(original)
    damaged[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(damaged))
    try:
      loaded = G.Guidance.load(str(path))
    except ValueError as e:
      assert str(e).startswith(f"{path} is not a readable guidance file"), e
      refused += 1
      continue
    # A flip the zip format ignores (a timestamp, say) may load: then the data must be equal.
    assert loaded.mode == guidance.mode and loaded.layers == guidance.layers
    assert set(loaded.sites) == set(guidance.sites)
    jax.tree.map(np.testing.assert_array_equal, loaded.sites, guidance.sites)
    np.testing.assert_array_equal(loaded.routing, guidance.routing)
  assert refused > 500
  path.write_bytes(original[: len(original) // 2])
  with pytest.raises(ValueError, match=rf"{path} is not a readable guidance file"):
    G.Guidance.load(str(path))


@pytest.mark.parametrize("shape, axis", [((0, 16), -1), ((3, 0), -1), ((4, 0, 32), -1)])
def test_quantize_of_an_empty_array_is_refused(shape, axis):
  with pytest.raises(ValueError, match=re.escape(f"x has shape {shape}, no elements to quantize")):
    fp4.quantize(jnp.zeros(shape), axis=axis)


def test_unknown_task_option_is_named():
  with pytest.raises(
    ValueError,
    match=r"task 'arith' has no option 'colour'; its options "
    r"\(with defaults\): terms=2, max_operand=9, ops='\+-'",
  ):
    preflight(RLConfig.from_flat(task="arith", task_options=(("colour", "red"),)))
  with pytest.raises(ValueError, match=r"task 'search' has no option 'bitz'"):
    get_task("search", bitz=3)
  with pytest.raises(ValueError, match=r"arith: terms=1"):  # values too, before any work
    preflight(RLConfig.from_flat(task="arith", task_options=(("terms", 1),)))


@pytest.mark.parametrize(
  "field, value",
  [
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("learning_rate", float("nan")),
    ("learning_rate", -1e-3),
  ],
)
def test_non_finite_or_negative_rates_are_refused(field, value):
  with pytest.raises(ValueError, match=rf"RLConfig.{field}={value!r} must be a finite number > 0"):
    RLConfig.from_flat(**{field: value})


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("clip_low", 5.0, r"LossConfig.clip_low=5.0 must lie in \[0, 1\)"),
    ("clip_low", 1.0, r"LossConfig.clip_low=1.0 must lie in \[0, 1\)"),
    ("clip_high", float("nan"), r"LossConfig.clip_high=nan must be a finite number >= 0"),
    ("tis_threshold", float("inf"), r"LossConfig.tis_threshold=inf must be a finite number"),
  ],
)
def test_loss_knobs_out_of_range_are_refused(field, value, match):
  with pytest.raises(ValueError, match=match):
    LossConfig(**{field: value})


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("mesh", (), r"RLConfig\.mesh=\(\) must be three device counts"),
    ("mesh", (1, 1), r"RLConfig\.mesh=\(1, 1\) must be three device counts"),
    ("mesh", (0, 1, 1), r"RLConfig\.mesh=\(0, 1, 1\) must be three device counts"),
    ("seed", 2**63, r"RLConfig\.seed=9223372036854775808 must be an integer that fits in int64"),
    ("seed", -(2**63) - 1, r"RLConfig\.seed=-9223372036854775809 must be an integer"),
  ],
)
def test_mesh_and_seed_out_of_range_are_named(field, value, match):
  with pytest.raises(ValueError, match=match):
    RLConfig.from_flat(**{field: value})


def test_extreme_seeds_within_int64_are_kept():
  assert RLConfig.from_flat(seed=2**63 - 1).seed == 2**63 - 1
  assert RLConfig.from_flat(seed=-(2**63)).seed == -(2**63)


def test_max_new_tokens_beyond_the_model_s_positions_is_refused_before_any_work():
  from trace_jax.model.config import get_preset
  from trace_jax.run import policy_source

  limit = get_preset("tiny").max_seq_len
  config = RLConfig.from_flat(preset="tiny", task="arith", max_new_tokens=limit)
  with pytest.raises(ValueError, match=rf"max_new_tokens={limit}: .* max_seq_len={limit}"):
    policy_source.check_fits(config, policy_source.preflight(config))
  ok = RLConfig.from_flat(preset="tiny", task="arith", max_new_tokens=limit // 4)
  policy_source.check_fits(ok, policy_source.preflight(ok))


def test_a_batch_that_cannot_fit_a_device_is_refused_by_the_estimate(monkeypatch):
  from trace_jax import memory_bound
  from trace_jax.model.config import get_preset
  from trace_jax.run import policy_source

  config = RLConfig.from_flat(preset="tiny", task="arith", prompts_per_step=64, group_size=4)
  task = policy_source.preflight(config)
  policy_source.check_fits(config, task)  # fits this machine
  cfg = get_preset("tiny")
  # The estimate's KV cache by hand: K and V, bf16, per layer, per slot, per sequence (and
  # the cache's few bytes of positions and lengths per slot).
  need = memory_bound.batch_lower_bound_bytes(cfg, 256, 48, chunk=16)
  per_slot = 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
  assert 256 * 48 * per_slot <= need["rollout"]["KV cache (bf16)"] <= 256 * 48 * (per_slot + 8)
  scores = need["rollout"]["prefill attention scores (f32)"]
  assert scores == 256 * cfg.num_heads * 16 * 48 * 4
  assert need["update"]["minibatch logits (f32)"] == 256 * 48 * cfg.vocab_size * 4
  assert need["update"]["LM head gradients (f32)"] == 3 * 256 * 48 * cfg.vocab_size * 4
  assert "pi_old" not in need
  unfused = memory_bound.batch_lower_bound_bytes(cfg, 256, 48, minibatch=64, fused=False)
  assert unfused["pi_old"] == {"batch logits (f32)": 256 * 48 * cfg.vocab_size * 4}
  assert unfused["update"]["minibatch logits (f32)"] == 64 * 48 * cfg.vocab_size * 4
  monkeypatch.setattr(memory_bound, "device_memory_bytes", lambda: 1e5)
  with pytest.raises(ValueError, match=r"prompts_per_step=64 x group_size=4 = 256 sequences"):
    policy_source.check_fits(config, task)


def test_a_batch_whose_update_cannot_fit_is_refused_though_cache_and_logits_would(monkeypatch):
  """--group_size=100000: the update holds the minibatch's float32 logits and three
  logits-sized buffers of their gradient at once, 4x the logits; a device holding the KV
  cache and the logits once (all the estimate counted before, so the run sat at step 0) but
  not that is refused, naming the flags and the bytes needed and available."""
  from trace_jax import memory_bound
  from trace_jax.model.config import get_preset
  from trace_jax.rl import episodes
  from trace_jax.run import policy_source

  config = RLConfig.from_flat(preset="tiny", task="arith", prompts_per_step=1, group_size=100000)
  task = policy_source.preflight(config)
  tokenizer, _ = policy_source.check(config, task)
  slots, _ = episodes.episode_len(config, task, tokenizer, policy_source.OBSERVATION_TOKENS)
  cfg = get_preset("tiny")
  logits = 100000 * slots * cfg.vocab_size * 4  # float32 [batch, slots, vocab]
  kv_bf16 = 100000 * slots * 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
  memory = 3 * logits  # > the bf16 KV cache and the logits once; < 4x the logits
  assert kv_bf16 + logits < memory
  monkeypatch.setattr(memory_bound, "device_memory_bytes", lambda: float(memory))
  with pytest.raises(ValueError) as refused:
    policy_source.check_fits(config, task)
  message = str(refused.value)
  assert "prompts_per_step=1 x group_size=100000 = 100000 sequences" in message
  assert f"need at least {4 * logits / 1e9:.1f} GB ({4 * logits} bytes) per device" in message
  assert (
    "in the update" in message and f"a device's {memory / 1e9:.1f} GB ({memory} bytes)" in message
  )


def test_the_final_line_of_a_run_without_steps_names_what_was_not_logged():
  from trace_jax.run import report

  summary = {
    "eval_precision": "fp4",
    "initial_eval_reward": 0.25,
    "final_eval_reward": 0.25,
    "mean_k3_kl": None,
    "guidance_bytes_per_token": None,
    "rollout_seconds": 0.0,
    "train_seconds": 0.0,
    "wall_seconds": 3.0,
  }
  line = report.final_line(summary)
  assert "eval reward 0.250 -> 0.250" in line and "mean k3_kl n/a" in line
  assert "guidance n/a B/token" in line


def _write_header(path, header, data_bytes):
  """A safetensors file whose header is `header` as given (hostile or not)."""
  blob = json.dumps(header).encode()
  path.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(data_bytes))


_F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
  "entry, match",
  [
    ({**_F32_4, "data_offsets": "0,16"}, r"data_offsets '0,16'; data_offsets is a list of two"),
    ({**_F32_4, "data_offsets": [0]}, r"data_offsets \[0\]; data_offsets is a list of two"),
    ({**_F32_4, "data_offsets": [0, 16.0]}, r"data_offsets \[0, 16.0\]; data_offsets is a list"),
    ({**_F32_4, "data_offsets": {"a": 0, "b": 16}}, r"data_offsets \{'a': 0, 'b': 16\}"),
    ({**_F32_4, "data_offsets": [0, 8, 16]}, r"data_offsets \[0, 8, 16\]"),
    ({**_F32_4, "dtype": ["F32"]}, r"unsupported dtype \['F32'\]; supported: \["),
    ({**_F32_4, "shape": "4"}, r"shape '4'; a shape is a list of integers >= 0"),
    ({**_F32_4, "shape": [-1, -4]}, r"shape \[-1, -4\]; a shape is a list of integers >= 0"),
    ({**_F32_4, "shape": [True, 4]}, r"shape \[True, 4\]; a shape is a list of integers >= 0"),
    ([0, 16], r"a malformed header entry \[0, 16\]"),
  ],
)
def test_a_hostile_safetensors_header_names_the_file_and_tensor(tmp_path, entry, match):
  path = tmp_path / "model.safetensors"
  _write_header(path, {"w": entry, "ok": {**_F32_4, "data_offsets": [16, 32]}}, 32)
  with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: tensor 'w' has " + match):
    hf.read_safetensors(str(path))


@pytest.mark.parametrize(
  "index, match",
  [
    ({"metadata": {}}, r"weight_map is None; it must be an object"),
    ({"weight_map": ["a.safetensors"]}, r"weight_map is \['a.safetensors'\]; it must be an object"),
    ({"weight_map": {"w": 7}}, r"weight_map\['w'\] is 7; it must be a shard file name"),
    ({"weight_map": {"w": "gone.safetensors"}}, r"weight_map names 'gone.safetensors', which is"),
  ],
)
def test_a_damaged_index_is_named(tmp_path, index, match):
  path = _hf_copy(tmp_path)
  (path / "model.safetensors.index.json").write_text(json.dumps(index))
  index_path = path / "model.safetensors.index.json"
  with pytest.raises(ValueError, match=rf"^{re.escape(str(index_path))}: " + match):
    hf.from_hf(str(path))


@pytest.mark.parametrize("config", [[1, 2], 7, "qwen3_moe", None])
def test_a_config_that_is_not_an_object_is_named(tmp_path, config):
  path = _hf_copy(tmp_path)
  (path / "config.json").write_text(json.dumps(config))
  message = rf"^{re.escape(str(path / 'config.json'))} is not a JSON object"
  with pytest.raises(ValueError, match=message):
    hf.from_hf(str(path))
  with pytest.raises(ValueError, match=message):  # the run's checks, before any weight
    check(RLConfig.from_flat(hf_checkpoint=str(path)), None)


def test_a_config_field_of_the_wrong_type_is_named(tmp_path):
  path = _hf_copy(tmp_path, lambda c: c.update(rope_parameters=["default"]))
  with pytest.raises(ValueError, match=rf"^{re.escape(str(path / 'config.json'))}: "):
    hf.from_hf(str(path))


def test_resolve_inside_refuses_what_leaves_the_directory(tmp_path):
  root = tmp_path / "ckpt"
  (root / "sub").mkdir(parents=True)
  (root / "sub" / "a.bin").write_bytes(b"a")
  (tmp_path / "secret").write_bytes(b"s")
  (root / "inside").symlink_to(root / "sub" / "a.bin")
  (root / "outside").symlink_to(tmp_path / "secret")
  (root / "up").symlink_to(tmp_path)  # a folder link on the way out
  assert resolve_inside(str(root), "sub/a.bin") == str(root / "sub" / "a.bin")
  assert resolve_inside(str(root), "inside") == str(root / "sub" / "a.bin")
  assert resolve_inside(str(root), "sub/../sub/a.bin") == str(root / "sub" / "a.bin")
  for name, target in [
    ("../secret", tmp_path / "secret"),
    (str(tmp_path / "secret"), tmp_path / "secret"),
    ("outside", tmp_path / "secret"),
    ("up/secret", tmp_path / "secret"),
    ("sub/../../secret", tmp_path / "secret"),
  ]:
    with pytest.raises(
      ValueError,
      match=rf"leads to {re.escape(str(target))}, outside the checkpoint folder "
      rf"{re.escape(str(root))};",
    ):
      resolve_inside(str(root), name)


def _outside_weights(tmp_path):
  """The fixture's weights in a folder beside the checkpoint (a file it must not read)."""
  outside = tmp_path / "outside"
  outside.mkdir()
  shutil.copy(FIXTURES / "qwen3_moe" / "model.safetensors", outside / "model.safetensors")
  return outside / "model.safetensors"


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_an_index_entry_outside_the_checkpoint_is_refused(tmp_path, how):
  path = _hf_copy(tmp_path)
  outside = _outside_weights(tmp_path)
  entry = "../outside/model.safetensors" if how == "dotdot" else str(outside)
  names = hf.read_safetensors(str(path / "model.safetensors"))
  (path / "model.safetensors").unlink()
  index = path / "model.safetensors.index.json"
  index.write_text(json.dumps({"weight_map": {n: entry for n in names}}))
  message = (
    rf"^{re.escape(str(index))}: weight_map names {re.escape(repr(entry))}: .*"
    rf"leads to {re.escape(str(outside))}, outside the checkpoint folder {re.escape(str(path))}"
  )
  with pytest.raises(ValueError, match=message):
    hf.from_hf(str(path))
  with pytest.raises(ValueError, match=message):
    preflight(RLConfig.from_flat(hf_checkpoint=str(path)))


def test_a_symlink_out_of_the_checkpoint_is_refused_one_inside_is_followed(tmp_path):
  path = _hf_copy(tmp_path)
  outside = _outside_weights(tmp_path)
  weights = path / "model.safetensors"
  (path / "real").mkdir()
  weights.rename(path / "real" / "weights.safetensors")
  weights.symlink_to("real/weights.safetensors")  # stays inside: loads
  assert hf.from_hf(str(path)).cfg.num_layers == 3
  preflight(RLConfig.from_flat(hf_checkpoint=str(path)))
  weights.unlink()
  (path / "real" / "weights.safetensors").unlink()
  weights.symlink_to(outside)
  message = rf"model.safetensors leads to {re.escape(str(outside))}, outside the checkpoint folder"
  with pytest.raises(ValueError, match=message):
    hf.from_hf(str(path))
  with pytest.raises(ValueError, match=message):
    preflight(RLConfig.from_flat(hf_checkpoint=str(path)))
  weights.unlink()
  weights.symlink_to("../outside/model.safetensors")  # relative, the same way out
  with pytest.raises(ValueError, match=message):
    hf.from_hf(str(path))


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_a_tokenizer_or_config_symlink_out_of_the_checkpoint_is_refused(tmp_path, name):
  path = _hf_copy(tmp_path)
  stolen = tmp_path / f"stolen_{name}"
  (path / name).rename(stolen)
  (path / name).symlink_to(stolen)
  with pytest.raises(
    ValueError, match=rf"{re.escape(name)} leads to {re.escape(str(stolen))}, outside"
  ):
    preflight(RLConfig.from_flat(hf_checkpoint=str(path)))


def test_a_hugging_face_hub_cache_snapshot_loads(tmp_path):
  # The hub cache links each file of models--x/snapshots/<revision>/ to models--x/blobs/.
  repo = tmp_path / "models--org--tiny"
  snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
  snapshot.mkdir(parents=True)
  blobs.mkdir()
  for i, file in enumerate(sorted((FIXTURES / "qwen3_moe").iterdir())):
    shutil.copy(file, blobs / f"blob{i}")
    (snapshot / file.name).symlink_to(f"../../blobs/blob{i}")
  reference = hf.from_hf(str(FIXTURES / "qwen3_moe"))
  loaded = hf.from_hf(str(snapshot))
  np.testing.assert_array_equal(loaded.embed.get_value(), reference.embed.get_value())
  preflight(RLConfig.from_flat(hf_checkpoint=str(snapshot)))
