"""`rl.step.score`: the KL reference's log-probs come from the reference's own forward."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.rl import step as step_lib
from trace_jax.rl.config import RLConfig
from trace_jax.rl.episodes import Episodes

PROMPTS = [[5, 17, 3, 8], [9, 2, 44, 7, 61, 8], [100, 3], [12, 13, 14, 15]]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def models():
  cfg = M.tiny()
  policy = M.Transformer(cfg, rngs=nnx.Rngs(11))
  reference = M.Transformer(cfg, rngs=nnx.Rngs(29))  # weights the rollout never saw
  return policy, reference


@pytest.fixture(scope="module")
def captured(models):
  """The policy's FP4 rollout with full guidance on every layer and its experts (the
  `trace-full` capture; `trace`'s compact capture is its mantissa bits)."""
  config = R.RolloutConfig(
    compute_dtype="float32",
    max_len=32,
    prompt_bucket=8,
    kernels="xla",
    guidance="full",
    guided_layers="all",
    record_routing=True,
    sampling=R.SamplingConfig(max_new_tokens=10, temperature=TEMPERATURE),
  )
  return R.RolloutEngine(models[0], config).generate(PROMPTS, jax.random.key(3))


@functools.partial(nnx.jit, static_argnums=4)
def _independent_logprobs(model, tokens, positions, mask, quant):
  """log p(token j | tokens < j) of `model` under `quant`, from its logits directly."""
  options = M.CallOptions(compute_dtype="float32")
  out = model(tokens, positions=positions, mask=mask, quant=quant, options=options)
  logp = jax.nn.log_softmax(out.logits[:, :-1] / TEMPERATURE, axis=-1)
  return jax.numpy.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]


@pytest.mark.slow  # a rollout and three forwards' compiles: about a minute on 2 cores
@pytest.mark.parametrize("arm", ["trace", "trace-full"])
def test_reference_logprobs_are_the_references_own_unguided_forward(models, captured, arm):
  """On a guided arm with routing replay, the reference (other weights than the policy whose
  rollout recorded the guidance) is scored by its own forward: the arm's FP4 format and sites,
  nearest rounding, fresh scales, its own experts. Scored with the rollout's guidance and
  routing, its log-probs differ from that forward at about half the tokens."""
  policy, reference = models
  config = RLConfig.from_flat(
    arm=arm,
    preset="tiny",
    prompts_per_step=1,
    group_size=len(PROMPTS),
    temperature=TEMPERATURE,
    kl_coef=0.05,
    compute_dtype="float32",
  )
  spec = step_lib.StepSpec.of(config, policy.cfg.num_layers)
  assert spec.arm.routing_replay and spec.static["quant"].rounding == "guided"
  guidance = captured.guidance if spec.arm.guidance == "full" else captured.guidance.to_compact()
  example = step_lib.TrainExample(
    tokens=captured.tokens,
    positions=captured.positions,
    mask=captured.mask,
    response_mask=captured.response_mask,
    rollout_logp=captured.logprobs,
  )
  rewards = np.arange(len(PROMPTS), dtype=np.float32)
  played = Episodes(rollout=captured, rewards=rewards, actions=[], turns=np.ones(len(PROMPTS)))
  collected = step_lib.Collected(
    played=played,
    rollout=captured,
    example=example,
    guidance=guidance.select_layers(spec.guided_layers),
  )
  state = step_lib.RLState(policy=policy, opt=None, reference=reference)
  scored = step_lib.score(spec, state, collected, step=1)

  plain = M.QuantConfig(
    fmt=config.fp4.fmt, sites=config.fp4.sites, activations=config.fp4.activations, kv=config.fp4.kv
  )
  want = np.asarray(
    _independent_logprobs(reference, captured.tokens, captured.positions, captured.mask, plain)
  )
  got = np.asarray(scored.ref_logp)
  valid = np.asarray(captured.mask)[:, 1:]
  assert np.all(got[:, 0] == 0)
  np.testing.assert_allclose(np.where(valid, got[:, 1:], 0), np.where(valid, want, 0), atol=2e-5)


def test_reference_static_is_the_training_path_for_unguided_arms():
  """Arms without guidance score the reference exactly as before: the training path's own
  static arguments (nearest rounding already, no replay)."""
  for arm in ("bf16", "fp4-rollout", "fp4-qat"):
    config = RLConfig.from_flat(arm=arm, preset="tiny", kl_coef=0.05)
    spec = step_lib.StepSpec.of(config, 2)
    assert spec.reference_static == spec.static
  for arm in ("trace", "trace-full"):
    spec = step_lib.StepSpec.of(RLConfig.from_flat(arm=arm, preset="tiny", kl_coef=0.05), 2)
    assert spec.reference_static["quant"].rounding == "nearest"
    assert spec.reference_static["replay"] is False
