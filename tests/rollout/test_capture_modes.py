"""What a rollout captures never changes what it samples, and every record is the FP4 of
the input recorded beside it.

bf16 compute, the rollout's default: there XLA may carry an activation in float32 inside a
fusion (excess precision) for one use and round it for another. Before the fix, sparse
capture's barrier rounded the `k` input and changed the log-probs, and the `k` records of
compact and full capture were not the FP4 of the recorded (rounded) `k` input.

Slow: eight compiles of the decode loop (~2 min on 2 cores); the same properties of one
forward run in the default suite (tests/model/test_quant.py):
  PYTHONPATH=$PWD pytest -n 0 -q -m slow tests/rollout/test_capture_modes.py
"""

import jax
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax import rollout as R

MODES = ("none", "compact", "full", "sparse")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rollouts(policy):
  """{mode: (first turn on the host, second turn)}: the same prompts, observations and keys
  under every capture mode; compact and full also keep their site inputs."""
  rng = np.random.default_rng(27)
  prompts = [rng.integers(0, 128, n).tolist() for n in (5, 9, 3, 12)]
  observations = [rng.integers(0, 128, n).tolist() for n in (2, 3, 1, 4)]
  out = {}
  for mode in MODES:
    config = R.RolloutConfig(
      max_len=64,
      prompt_bucket=16,
      guidance=mode,
      guided_layers="all",
      kernels="xla",
      sampling=R.SamplingConfig(max_new_tokens=12),
    )
    engine = R.RolloutEngine(policy, config, capture_inputs=mode in ("compact", "full"))
    first = engine.generate(prompts, jax.random.key(3))
    host = first.to_host()
    out[mode] = (host, engine.continue_(first, observations, jax.random.key(4)))
  return out


@pytest.mark.parametrize("mode", MODES[1:])
def test_capture_mode_never_changes_the_rollout(rollouts, mode):
  """Tokens, masks and both log-probs of every turn are those of guidance="none", bits
  included (the key fixes the draws; only the capture differs)."""
  for turn in (0, 1):
    want, got = rollouts["none"][turn], rollouts[mode][turn]
    for field in ("tokens", "positions", "response_mask", "env_mask", "logprobs"):
      np.testing.assert_array_equal(
        np.asarray(getattr(got, field)),
        np.asarray(getattr(want, field)),
        err_msg=f"turn {turn} {field}",
      )
    np.testing.assert_array_equal(
      np.asarray(got.sampling_logprobs), np.asarray(want.sampling_logprobs)
    )
  assert np.asarray(rollouts[mode][1].response_mask).sum() > 4 * 12  # two turns sampled


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_every_record_is_the_fp4_of_its_recorded_input(rollouts, mode):
  """At every recorded site of both turns (prefill and decode steps), the record equals
  `fp4.quantize` of the recorded input, and the FP4 cache holds exactly that K and V."""
  for turn in (0, 1):
    rollout = rollouts[mode][turn]
    valid = np.asarray(rollout.mask)
    assert set(rollout.site_inputs) == set(rollout.guidance.sites)
    for key, record in rollout.guidance.sites.items():
      x = rollout.site_inputs[key]
      expected = fp4.quantize(x, global_group="row")
      if mode == "compact":
        expected = fp4.compact_guidance(expected)
      fields = [
        f for f in ("packed", "mantissa_bits", "scales", "global_scale") if hasattr(record, f)
      ]
      for field in fields:
        np.testing.assert_array_equal(
          np.asarray(getattr(record, field))[valid],
          np.asarray(getattr(expected, field))[valid],
          err_msg=f"turn {turn} {key} {field}",
        )
  cache = rollouts[mode][1].cache
  valid = np.asarray(rollouts[mode][1].mask)
  for layer in range(len(cache.k)):
    for name, entries in (("k", cache.k), ("v", cache.v)):
      expected = fp4.quantize(rollouts[mode][1].site_inputs[(layer, name)], global_group="row")
      for field in ("packed", "scales", "global_scale"):
        np.testing.assert_array_equal(
          np.asarray(getattr(entries[layer], field))[valid],
          np.asarray(getattr(expected, field))[valid],
          err_msg=f"cache {layer} {name} {field}",
        )
