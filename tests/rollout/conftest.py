"""Shared rollout-test setup: a module's policy (from its `preset`) and a float32 greedy
engine over it. A test module picks the architecture by overriding `preset` (and the
engine's `greedy_max_len`)."""

import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax import rollout as R


@pytest.fixture(scope="module")
def preset():
  return "tiny"


@pytest.fixture(scope="module")
def greedy_max_len():
  return 64


@pytest.fixture(scope="module")
def policy(preset):
  return M.Transformer(M.get_preset(preset), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def f32_greedy(policy, greedy_max_len):
  """bf16 weights, float32 compute, greedy, 8 new tokens, no guidance."""
  config = R.RolloutConfig(
    precision="bf16",
    compute_dtype="float32",
    guidance="none",
    max_len=greedy_max_len,
    prompt_bucket=8,
    sampling=R.SamplingConfig(greedy=True, max_new_tokens=8),
  )
  return R.RolloutEngine(policy, config)
