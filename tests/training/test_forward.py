"""The guided training path against the rollout it follows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as G
from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax import training as T
from trace_jax.rl import metrics

PROMPTS = [[5, 17, 3, 8], [9, 2, 44, 7, 61, 8, 30], [100, 3], [12, 13, 14, 15, 16]]
GRID = np.asarray(fp4.E2M1_GRID, np.float32)
FULL_ALL = M.QuantConfig(rounding="guided", guided_layers="all")


@pytest.fixture(scope="module")
def captured(policy):
  """An FP4 rollout with full guidance on all layers and the activations it quantized."""
  config = R.RolloutConfig(
    precision="fp4",
    compute_dtype="float32",
    guidance="full",
    guided_layers="all",
    max_len=32,
    prompt_bucket=8,
    sampling=R.SamplingConfig(max_new_tokens=12),
  )
  return R.RolloutEngine(policy, config, capture_inputs=True).generate(PROMPTS, jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _jitted(quant, routing_replay, record_inputs):
  options = M.CallOptions(
    compute_dtype="float32", recording=M.Recording(form="full", inputs=record_inputs)
  )
  return nnx.jit(
    lambda m, r, g: T.training_forward(
      m,
      r.tokens,
      r.positions,
      r.mask,
      quant=quant,
      guidance=g,
      routing_replay=routing_replay,
      options=options,
    )
  )


def _forward(policy, rollout, quant, guidance, routing_replay=True, record_inputs=True):
  """(log-probs, ModelOutput) of the training path, recording every site in full."""
  return _jitted(quant, routing_replay, record_inputs)(policy, rollout.without_cache(), guidance)


def _brackets(v):
  """Signed grid bracket of v: (sign, lo code, hi code), independently of trace_jax.fp4."""
  m = np.minimum(np.abs(v), 6.0)
  lo = np.searchsorted(GRID, m, side="right") - 1
  hi = np.searchsorted(GRID, m, side="left")
  return np.sign(v), lo, hi


def _shared_neighbours(rollout_x, train_x, q):
  """Elements whose rollout and training values lie between the same two grid neighbours,
  in the units of the rollout's recorded scales."""
  block = q.format.block_size
  step = np.repeat(np.asarray(q.format.decode_scales(q.scales) / q.global_scale), block, -1)
  with np.errstate(divide="ignore", invalid="ignore"):
    a = _brackets(np.where(step > 0, np.asarray(rollout_x, np.float32) / step, 0))
    b = _brackets(np.where(step > 0, np.asarray(train_x, np.float32) / step, 0))
  return (a[0] == b[0]) & (a[1] == b[1]) & (a[2] == b[2])


@pytest.mark.parametrize("mode", ["full", "compact"])
def test_guided_codes_equal_the_rollout_codes_where_neighbours_are_shared(policy, captured, mode):
  guidance = captured.guidance if mode == "full" else captured.guidance.to_compact()
  _, aux = _forward(policy, captured, FULL_ALL, guidance)
  valid = np.asarray(captured.mask)
  shared_total = not_shared = 0
  for key, recorded in captured.guidance.sites.items():
    shared = _shared_neighbours(captured.site_inputs[key], aux.site_inputs[key], recorded)
    weights = np.broadcast_to(valid.reshape(valid.shape + (1,) * (shared.ndim - 2)), shared.shape)
    train_codes = np.asarray(fp4.codes(aux.sites[key]))
    rollout_codes = np.asarray(fp4.codes(recorded))
    np.testing.assert_array_equal(
      train_codes[shared & weights], rollout_codes[shared & weights], err_msg=str(key)
    )
    shared_total += int(np.sum(shared & weights))
    not_shared += int(np.sum(~shared & weights))
  assert shared_total > 10000
  # Same scales and values within float32 reduction-order noise: almost everything is shared.
  assert not_shared < 0.01 * shared_total


def test_guided_mismatch_is_below_nearest_rounding(policy):
  """bf16 compute on both paths: decode vs prefill differ; full guidance removes most of it."""
  config = R.RolloutConfig(
    precision="fp4",
    compute_dtype="bfloat16",
    guidance="full",
    guided_layers="all",
    max_len=32,
    prompt_bucket=8,
    sampling=R.SamplingConfig(max_new_tokens=12),
  )
  rollout = R.RolloutEngine(policy, config).generate(PROMPTS * 4, jax.random.key(1))
  run = nnx.jit(
    lambda m, r, g, quant, replay: T.training_forward(
      m,
      r.tokens,
      r.positions,
      r.mask,
      guidance=g,
      routing_replay=replay,
      quant=quant,
      options=M.CallOptions(compute_dtype="bfloat16", recording=M.Recording(form="full")),
    ),
    static_argnums=(3, 4),
  )
  stats = {}
  for name, quant, replay in (("none", M.QuantConfig(), False), ("full", FULL_ALL, True)):
    logp, aux = run(policy, rollout.without_cache(), rollout.guidance, quant, replay)
    stats[name] = (
      metrics.mismatch_metrics(rollout.logprobs, logp, rollout.response_mask),
      metrics.code_disagreement(rollout.guidance.sites, aux.sites, rollout.mask),
    )
  assert stats["none"][1]["code_disagree_frac"] > 0  # the paths really differ
  assert stats["full"][1]["code_disagree_frac"] < stats["none"][1]["code_disagree_frac"] / 5
  assert stats["full"][0]["mismatch/k3_kl"] < stats["none"][0]["mismatch/k3_kl"]
  assert stats["full"][0]["mismatch/logp_abs_diff"] < stats["none"][0]["mismatch/logp_abs_diff"]


def test_guided_gradients_equal_nearest_ste_gradients(policy, captured):
  """Guidance recorded from the training path's own nearest-rounding forward reproduces it,
  so loss and gradients through the guided forward equal those through nearest rounding."""
  tokens, positions, mask = captured.tokens, captured.positions, captured.mask
  quant = M.QuantConfig()
  recording = M.CallOptions(recording=M.Recording(form="full"))
  aux = nnx.jit(
    lambda m: m(tokens, positions=positions, mask=mask, quant=quant, options=recording)
  )(policy)
  own = G.Guidance(
    sites=dict(aux.sites), routing=aux.routing.astype(jnp.int8), mode="full", layers=(0, 1)
  )

  def loss(model, quant, guidance, replay):
    logp, _ = T.training_forward(
      model, tokens, positions, mask, quant=quant, guidance=guidance, routing_replay=replay
    )
    return -jnp.sum(logp * captured.response_mask)

  grad = nnx.jit(nnx.grad(loss), static_argnums=(1, 3))
  reference = grad(policy, quant, None, False)
  for guidance in (own, own.to_compact()):
    guided = grad(policy, FULL_ALL, guidance, True)
    # Same values and the same STE; only float32 reduction orders of the two graphs differ.
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(np.abs(b).max())),
      guided,
      reference,
    )


def test_guidance_that_does_not_fit_is_an_error(policy, captured):
  r = captured.without_cache()
  g = captured.guidance
  with pytest.raises(ValueError, match="needs guidance"):
    T.training_forward(policy, r.tokens, r.positions, r.mask, quant=FULL_ALL)
  with pytest.raises(ValueError, match="the batch is 4 x 24"):
    T.training_forward(
      policy,
      r.tokens[:, :24],
      r.positions[:, :24],
      r.mask[:, :24],
      quant=FULL_ALL,
      guidance=g,
      routing_replay=True,
    )
  with pytest.raises(ValueError, match="missing \\[0\\]"):
    T.training_forward(
      policy,
      r.tokens,
      r.positions,
      r.mask,
      quant=FULL_ALL,
      guidance=g.select_layers([1]),
      routing_replay=True,
    )
  with pytest.raises(ValueError, match="routing replay needs recorded routing"):
    T.training_forward(
      policy,
      r.tokens,
      r.positions,
      r.mask,
      quant=M.QuantConfig(),
      guidance=g.without_routing(),
      routing_replay=True,
    )
  with pytest.raises(ValueError, match="needs routing_replay=True"):
    T.training_forward(
      policy, r.tokens, r.positions, r.mask, quant=FULL_ALL, guidance=g, routing_replay=False
    )
  # Guiding only attention sites does not depend on the experts: no replay needed.
  attention_only = M.QuantConfig(rounding="guided", guided_layers="all", sites=("attn_in", "k"))
  T.training_forward(
    policy, r.tokens, r.positions, r.mask, quant=attention_only, guidance=g, routing_replay=False
  )
  with pytest.raises(ValueError, match="lacks sites"):
    partial = G.Guidance(
      sites={k: v for k, v in g.sites.items() if k[1] != "v"},
      routing=g.routing,
      mode="full",
      layers=g.layers,
    )
    T.training_forward(
      policy, r.tokens, r.positions, r.mask, quant=FULL_ALL, guidance=partial, routing_replay=True
    )


def test_guidance_pytree_scans_over_layers(captured):
  """Stacked per-layer guidance of one site goes through lax.scan (and grad) as a pytree."""
  sites = captured.guidance.to_compact().sites
  stacked = jax.tree.map(
    lambda *xs: jnp.stack(xs), *[sites[(layer, "attn_in")] for layer in (0, 1)]
  )
  x = jnp.stack([captured.site_inputs[(layer, "attn_in")] for layer in (0, 1)])

  def total(x):
    def body(carry, inputs):
      x_l, g_l = inputs
      return carry + jnp.sum(fp4.fake_quant(x_l, rounding="guided", guidance=g_l)), None

    return jax.lax.scan(body, 0.0, (x, stacked))[0]

  value, grad = jax.jit(jax.value_and_grad(total))(x)
  expected = sum(
    jnp.sum(fp4.fake_quant(x[i], rounding="guided", guidance=sites[(i, "attn_in")])) for i in (0, 1)
  )
  np.testing.assert_allclose(value, expected, rtol=1e-6)
  np.testing.assert_array_equal(grad, jnp.ones_like(x))
