"""The mismatch study's parts (trace_jax/studies/mismatch.py) on tiny inputs: its rows keep
the JSON keys experiments/mismatch.py always wrote, its targets against a hand computation,
and one training-path measurement on the tiny preset against numpy (slow). The whole study runs
in tests/studies/test_mismatch_script.py (slow)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax.model.config import tiny
from trace_jax.model.quant import QuantConfig
from trace_jax.model.transformer import Transformer
from trace_jax.rl.metrics import fp4_disagreement, guidance_agreement, mismatch_metrics
from trace_jax.rollout.config import RolloutConfig, SamplingConfig
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.studies import mismatch, sparse
from trace_jax.tasks.tokenizer import CharTokenizer

MISMATCH_KEYS = {
  "k3_kl",
  "kl",
  "logp_abs_diff",
  "prob_diff_mean",
  "prob_diff_max",
  "is_ratio/mean",
  "is_ratio/max",
  "is_ratio/min",
  "tis/clip_frac",
  "code_disagree_frac",
  "one_step_frac",
}
QUANTIZED_KEYS = {"mantissa_disagree_frac", "scale_disagree_frac", "per_layer"}
GUIDED_KEYS = {"guidance/followed_frac", "guidance/fallbacks"}


def test_study_config_json_keeps_the_flat_keys():
  keys = {
    "preset", "task", "seed", "sft_steps", "sft_batch", "sft_lr", "rollouts", "new_tokens",
    "temperature", "compute_dtype", "fmt", "fp4_sites", "kernels", "delta", "delta_sweep",
    "delta_quantile", "geometries", "layer_sweep",
  }  # fmt: skip
  config = mismatch.StudyConfig()
  assert set(config.to_json()) == keys and config.to_json()["fp4_sites"] == "all"
  w4a8 = dataclasses.replace(config, fp4=QuantConfig(activations="fp8"))
  assert set(w4a8.to_json()) == keys | {"activations"}
  bf16_kv = dataclasses.replace(config, fp4=QuantConfig(kv="bf16"))
  assert set(bf16_kv.to_json()) == keys | {"kv_precision"}
  skewed = mismatch.StudyConfig(rollout_skew=2**-7)  # recorded when it is not 0
  assert skewed.to_json() == {**config.to_json(), "rollout_skew": 2**-7}
  tokenizer = CharTokenizer()
  for kind in (dict(precision="fp4"), dict(precision="bf16", guidance="none")):  # both
    assert mismatch._rollout_config(skewed, tokenizer, **kind).skew == 2**-7
  with pytest.raises(ValueError, match=r"StudyConfig\.rollout_skew=-0\.5 is not allowed"):
    mismatch.StudyConfig(rollout_skew=-0.5)


def _measurement(rng, quantized: bool, guided: bool) -> mismatch.Measurement:
  shape = (3, 10)
  rollout_logp = jnp.asarray(rng.normal(-1.0, 0.5, shape), jnp.float32)
  train_logp = rollout_logp + jnp.asarray(rng.normal(0, 0.05, shape), jnp.float32)
  mask = jnp.asarray(rng.uniform(size=shape) < 0.8)
  m = mismatch_metrics(rollout_logp, train_logp, mask)
  if not quantized:
    return mismatch.Measurement.of(m, None, {}), m, None
  x = jnp.asarray(rng.normal(size=shape + (16,)), jnp.float32)
  sites_r = {(0, "moe_in"): fp4.quantize(x, global_group="row")}
  sites_t = {(0, "moe_in"): fp4.quantize(x * 1.01, global_group="row")}
  d = fp4_disagreement(sites_r, sites_t, mask)
  fallbacks = {(0, "moe_in"): jnp.asarray(rng.uniform(size=shape + (16,)) < 0.1)}
  agreement = guidance_agreement(fallbacks, mask) if guided else {}
  return mismatch.Measurement.of(m, d, agreement), m, d


@pytest.mark.parametrize("quantized, guided", [(False, False), (True, False), (True, True)])
def test_measurement_keeps_the_row_keys_and_values(quantized, guided):
  rng = np.random.default_rng()
  row, m, d = _measurement(rng, quantized, guided)
  json = row.to_json()
  expected = MISMATCH_KEYS | (QUANTIZED_KEYS if quantized else set())
  assert set(json) == expected | (GUIDED_KEYS if guided else set())
  assert json["k3_kl"] == m["mismatch/k3_kl"] and json["is_ratio/min"] == m["is_ratio/min"]
  assert json["tis/clip_frac"] == m["tis/clip_frac"]
  if quantized:
    assert json["code_disagree_frac"] == d["code_disagree_frac"] is not None
    assert json["per_layer"] == d["per_layer"]
  else:
    assert json["code_disagree_frac"] is None and json["one_step_frac"] is None


def _sparse_row(measurement, bytes_per_token: float) -> sparse.SparseRow:
  cost = sparse.SiteCost(element_bits=1.0, block_bits=2.0, density=0.1, block_density=0.2)
  return sparse.SparseRow(
    measurement=measurement,
    delta=0.05,
    scale_delta=0.19,
    site_deltas={},
    site_quantile=None,
    bytes_per_token=bytes_per_token,
    bytes={"positions": 1.0},
    element_position_bytes_per_token={"gamma": 1.0},
    density=0.1,
    block_density=0.2,
    overflow=0,
    block_overflow=0,
    costs={"all": cost},
  )


def test_targets_by_hand():
  """Reductions against none+replay, and the cheapest sparse row within 1.5x of compact's
  k3 (a cheaper one beyond it is passed over)."""
  rng = np.random.default_rng()
  base, _, _ = _measurement(rng, quantized=True, guided=True)
  k3 = dict(zip(mismatch.MODES, rng.uniform(1e-6, 1e-3, len(mismatch.MODES))))
  modes = {m: dataclasses.replace(base, k3_kl=float(v)) for m, v in k3.items()}
  compact = k3["compact"]
  rows = [
    _sparse_row(dataclasses.replace(base, k3_kl=compact * 1.2), 40.0),
    _sparse_row(dataclasses.replace(base, k3_kl=compact * 1.4), 30.0),  # the best
    _sparse_row(dataclasses.replace(base, k3_kl=compact * 1.6), 10.0),  # too far
  ]
  bytes_per_token = {"compact": 600.0, "full": 2400.0, "sparse": 40.0}
  goals = mismatch.targets(modes, bytes_per_token, rows)
  assert goals.full_k3_reduction == pytest.approx(k3["none+replay"] / k3["full"])
  assert goals.compact_k3_reduction == pytest.approx(k3["none+replay"] / compact)
  assert goals.replay_k3_reduction == pytest.approx(k3["none"] / k3["none+replay"])
  assert goals.bytes_ratio_full_over_compact == 4.0
  assert goals.sparse.best is rows[1]
  json = goals.to_json()
  best = json["sparse"]["within_1.5x"]
  assert (best["full_over_sparse"], best["compact_over_sparse"]) == (80.0, 20.0)
  assert "met" not in json and "met" not in json["sparse"]  # targets are the script's
  none = mismatch.targets(modes, bytes_per_token, rows[2:]).to_json()["sparse"]
  assert none == {"compact_k3": compact, "within_1.5x": None}


@pytest.mark.slow  # ~18 s of CPU: a rollout and a training path compile
def test_one_measurement_on_the_tiny_preset():
  """Slow: it compiles a rollout and a training path (~18 s of CPU on 2 cores).

  `measure` of FP4 QAT with nearest rounding against an FP4 rollout capturing full
  guidance: its k3 is numpy's k3 of the two paths' log-probs, and its code disagreement the
  share of real tokens' codes that differ, both recomputed here from the raw outputs."""
  cfg = tiny(num_layers=1)
  policy = Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 16))))
  config = mismatch.StudyConfig(preset="tiny", temperature=1.0, compute_dtype="float32")
  rollout_config = RolloutConfig(
    precision="fp4", compute_dtype="float32", max_len=24, prompt_bucket=8, guidance="full",
    guided_layers="all", record_routing=True, kernels="xla",
    sampling=SamplingConfig(temperature=1.0, max_new_tokens=8),
  )  # fmt: skip
  prompts = [[1, 5, 6, 7], [2, 9], [3, 4, 8, 10, 11]]
  rollout = RolloutEngine(policy, rollout_config).generate(prompts, jax.random.key(1))
  full = rollout.guidance
  nearest = QuantConfig()
  row, (train_sites, _) = mismatch.measure(
    config, policy, rollout, full.sites, nearest, None, False, inputs=True
  )
  assert row.followed_frac is None  # nothing guided
  logp, _ = mismatch.training_path(  # the same compiled forward: its log-probs
    policy,
    rollout.without_cache(),
    None,
    quant=nearest,
    compute_dtype="float32",
    replay=False,
    temperature=1.0,
    inputs=True,
  )
  response = np.asarray(rollout.response_mask)
  log_ratio = (np.asarray(logp) - np.asarray(rollout.logprobs))[response]
  assert row.k3_kl == pytest.approx(np.mean(np.exp(log_ratio) - 1 - log_ratio), rel=1e-4)
  mask = np.asarray(rollout.mask)
  differ = total = 0
  for key, q in full.sites.items():
    a, b = np.asarray(fp4.codes(q)), np.asarray(fp4.codes(train_sites[key]))
    real = np.broadcast_to(mask.reshape(mask.shape + (1,) * (a.ndim - 2)), a.shape)
    differ, total = differ + int(np.sum((a != b) & real)), total + int(real.sum())
  assert row.code_disagree_frac == pytest.approx(differ / total)


@pytest.mark.slow  # ~60 s of CPU: two skews' rollouts and training paths compile
def test_a_skewed_study_rolls_out_farther_from_the_training_path():
  """The study's rollouts at rollout_skew > 0 are farther from the (never skewed) training
  path than at 0: k3 of bf16 and of FP4 QAT (nearest) against them, and FP4 code
  disagreement, all rise."""
  cfg = tiny(num_layers=2)
  policy = Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 16))))
  prompts = [[1, 5, 6, 7], [2, 9], [3, 4, 8, 10, 11], [12, 13]]
  rows = []
  for skew in (0.0, 2**-4):
    config = mismatch.StudyConfig(
      preset="tiny", compute_dtype="float32", new_tokens=8, kernels="xla", rollout_skew=skew
    )
    rollouts = mismatch._roll_out(config, policy, CharTokenizer(), prompts)
    full = rollouts.full.sites
    bf16, _ = mismatch.measure(config, policy, rollouts.bf16, full, None, None, False)
    qat, _ = mismatch.measure(config, policy, rollouts.fp4, full, QuantConfig(), None, False)
    rows.append((bf16.k3_kl, qat.k3_kl, qat.code_disagree_frac))
  (bf16_0, qat_0, codes_0), (bf16_s, qat_s, codes_s) = rows
  assert bf16_s > 10 * bf16_0 and qat_s > qat_0 and codes_s > codes_0


@pytest.mark.parametrize("field, value", [("seed", 1), ("sft_steps", 1), ("preset", "small")])
def test_a_warm_start_is_refused_for_other_warm_start_settings(field, value):
  """run_study takes a warm start only for the settings it was made for, and says which."""
  config = mismatch.StudyConfig(preset="tiny", sft_steps=0)
  warm = mismatch.warm_start(config, progress=False)  # no SFT steps: the initialised policy
  assert warm.settings == {f: getattr(config, f) for f in mismatch.WARM_START_FIELDS}
  other = dataclasses.replace(config, **{field: value})
  with pytest.raises(ValueError, match=f"'{field}': {value!r}"):
    mismatch.run_study(other, progress=False, warm=warm)
