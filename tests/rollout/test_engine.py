"""The rollout engine: exactness against the full forward, cache and guidance contents,
stop tokens and masks, multi-turn continuation, reproducibility, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.model.quantizer import SiteQuantizer

PROMPTS = [[5, 17, 3], [9, 2, 44, 7, 61, 8, 30], [100]]


# `policy` (the tiny preset) and `f32_greedy` come from conftest.py.


STOPS = tuple(range(0, 128, 2))  # every even token: sequences stop early, at various steps


@pytest.fixture(scope="module")
def fp4_compact(policy):
  """FP4, compact guidance on layer 1, stop tokens, sampling at T=1.

  float32 compute: with bf16, XLA may keep excess precision inside a fusion, so the value it
  quantizes is not exactly the bf16 activation it stores (see docs of the mismatch study).
  """
  config = R.RolloutConfig(
    precision="fp4",
    guidance="compact",
    guided_layers=1,
    max_len=48,
    prompt_bucket=8,
    compute_dtype="float32",
    sampling=R.SamplingConfig(max_new_tokens=10, stop_tokens=STOPS),
  )
  return R.RolloutEngine(policy, config, capture_inputs=True)


@pytest.fixture(scope="module")
def fp4_full(policy):
  """FP4, float32 compute, full guidance on all layers, activations kept for checking."""
  config = R.RolloutConfig(
    precision="fp4",
    compute_dtype="float32",
    guidance="full",
    guided_layers="all",
    max_len=48,
    prompt_bucket=8,
    sampling=R.SamplingConfig(max_new_tokens=6, temperature=1.0),
  )
  return R.RolloutEngine(policy, config, capture_inputs=True)


def test_quantize_params_equal_the_training_path_weights_bit_for_bit(policy):
  quant = M.QuantConfig()
  packed = R.quantize_params(nnx.state(policy), quant)
  sq = SiteQuantizer(quant, policy.cfg.num_layers, jnp.float32)
  masters = dict(nnx.to_flat_state(nnx.state(policy)))
  packed_flat = dict(nnx.to_flat_state(packed))
  # The siblings the forward multiplies as one fused matrix (attention.py, moe.py).
  fused = (("q_proj", "k_proj", "v_proj"), ("w_gate", "w_up"))
  checked = 0
  for path, var in packed_flat.items():
    value, master = var.get_value(), masters[path].get_value()
    if M.is_quantized_weight(var):
      assert isinstance(value, fp4.QArray)
      # The training path quantizes the weight together with its shared-scale siblings.
      group = next((g for g in fused if path[-1] in g), (path[-1],))
      siblings = [masters[path[:-1] + (name,)].get_value() for name in group]
      train = sq.weight_group(siblings, M.weight_group(var))[group.index(path[-1])]
      np.testing.assert_array_equal(fp4.dequantize(value), train)
      first = packed_flat[path[:-1] + (group[0],)].get_value()
      np.testing.assert_array_equal(value.global_scale, first.global_scale)
      checked += 1
    else:  # embedding, LM head, router, norms stay in high precision
      assert value.dtype == jnp.float32
      np.testing.assert_array_equal(value, master)
  assert checked == 14
  # q/k/v and gate/up really share: the shared scale is the smallest of the separate ones.
  attn = packed_flat[("blocks", 0, "attn", "q_proj")].get_value()
  alone = [
    M.quantize_weight(masters[("blocks", 0, "attn", n)].get_value(), "nvfp4").global_scale
    for n in ("q_proj", "k_proj", "v_proj")
  ]
  np.testing.assert_array_equal(attn.global_scale, np.minimum.reduce(alone))
  assert len({float(np.asarray(a).item()) for a in alone}) > 1  # separate scales would differ
  # A bf16 rollout casts only the linear weights: router, LM head, norms and embedding stay
  # float32 exactly as in the FP4 rollouts, so the bf16 arm carries no extra mismatch.
  bf16 = R.quantize_params(nnx.state(policy), None)
  for (path, var), (_, master) in zip(
    nnx.to_flat_state(bf16), nnx.to_flat_state(nnx.state(policy))
  ):
    expected = master.get_value().astype(
      jnp.bfloat16 if M.is_quantized_weight(master) else jnp.float32
    )
    assert var.get_value().dtype == expected.dtype, path
    np.testing.assert_array_equal(var.get_value(), expected)
  assert {str(p[-1]) for p, v in nnx.to_flat_state(bf16) if v.get_value().dtype == jnp.float32} >= {
    "router",
    "lm_head",
    "embed",
  }
  assert R.params_nbytes(packed) < 0.6 * R.params_nbytes(nnx.state(policy))


def test_greedy_generation_equals_stepwise_argmax_of_the_full_forward(policy, f32_greedy):
  rollout = f32_greedy.generate(PROMPTS, jax.random.key(0))
  # Right-padded to one length (causal: padding after a token cannot change it): one compile.
  forward = nnx.jit(lambda m, t: m(t).logits)
  for prompt, response, logps in zip(
    PROMPTS,
    rollout.responses(),
    np.asarray(rollout.logprobs)[np.asarray(rollout.response_mask)].reshape(len(PROMPTS), -1),
  ):
    assert len(response) == 8
    sequence = list(prompt)
    for token, logp in zip(response, logps):
      padded = jnp.asarray([sequence + [0] * (16 - len(sequence))])
      logits = forward(policy, padded)[0, len(sequence) - 1]
      assert token == int(jnp.argmax(logits))
      np.testing.assert_allclose(logp, jax.nn.log_softmax(logits)[token], rtol=1e-5, atol=1e-5)
      sequence.append(token)
  assert rollout.finish_reasons() == ["length"] * 3


def test_masks_positions_and_lengths(f32_greedy):
  rollout = f32_greedy.generate(PROMPTS, jax.random.key(0))
  lengths = [len(p) + 8 for p in PROMPTS]
  np.testing.assert_array_equal(rollout.lengths, lengths)
  np.testing.assert_array_equal(np.asarray(rollout.prompt_mask).sum(-1), [len(p) for p in PROMPTS])
  assert not np.asarray(rollout.env_mask).any()
  for row, seq in enumerate(rollout.sequences()):
    assert seq[: len(PROMPTS[row])] == PROMPTS[row]
    mask = np.asarray(rollout.mask[row])
    np.testing.assert_array_equal(np.asarray(rollout.positions[row])[mask], np.arange(lengths[row]))
  assert not (np.asarray(rollout.prompt_mask) & np.asarray(rollout.response_mask)).any()


def test_fp4_cache_holds_exactly_the_quantized_k_and_v(policy, fp4_full):
  rollout = fp4_full.generate(PROMPTS, jax.random.key(1))
  valid = np.asarray(rollout.mask)
  for layer in range(policy.cfg.num_layers):
    for name, entries in (("k", rollout.cache.k), ("v", rollout.cache.v)):
      activation = rollout.site_inputs[(layer, name)]  # what the engine computed, pre-FP4
      expected = fp4.quantize(activation, global_group="row")
      cached = entries[layer]
      for field in ("packed", "scales", "global_scale"):
        np.testing.assert_array_equal(
          np.asarray(getattr(cached, field))[valid], np.asarray(getattr(expected, field))[valid]
        )
  # Layer 0's keys depend on the token alone: they equal the full forward's bit for bit.
  tokens = jnp.asarray(rollout.tokens)
  recording = M.CallOptions(recording=M.Recording(form="full"))
  aux = nnx.jit(
    lambda m, t, p, k: m(t, positions=p, mask=k, quant=M.QuantConfig(), options=recording)
  )(policy, tokens, rollout.positions, rollout.mask)
  np.testing.assert_array_equal(
    np.asarray(rollout.cache.k[0].packed)[valid], np.asarray(aux.sites[(0, "k")].packed)[valid]
  )


@pytest.mark.parametrize("mode", ["full", "compact"])
def test_captured_guidance_is_fp4_of_the_recorded_activations(fp4_full, fp4_compact, mode):
  engine = fp4_full if mode == "full" else fp4_compact
  rollout = engine.generate(PROMPTS, jax.random.key(2))
  guidance = rollout.guidance
  valid = np.asarray(rollout.mask)
  layers = (0, 1) if mode == "full" else (1,)
  assert guidance.mode == mode and guidance.layers == layers
  assert {k[0] for k in guidance.sites} == set(layers)
  for key, entry in guidance.sites.items():
    expected = fp4.quantize(rollout.site_inputs[key], global_group="row")
    if mode == "compact":
      expected = fp4.compact_guidance(expected)
      assert isinstance(entry, fp4.CompactGuidance)
    for field in [
      f for f in ("packed", "mantissa_bits", "scales", "global_scale") if hasattr(entry, f)
    ]:
      np.testing.assert_array_equal(
        np.asarray(getattr(entry, field))[valid],
        np.asarray(getattr(expected, field))[valid],
        err_msg=str(key),
      )
  # Routing replay: the experts the full forward picks when told to replay them.
  np.testing.assert_array_equal(guidance.routing, rollout.routing)
  assert guidance.routing.dtype == jnp.int8


def test_stop_tokens_end_sequences_and_masks_are_right(fp4_compact):
  config = fp4_compact.config
  rollout = fp4_compact.generate(PROMPTS * 3, jax.random.key(3))
  reasons = rollout.finish_reasons()
  assert "stop" in reasons
  tokens, response = np.asarray(rollout.tokens), np.asarray(rollout.response_mask)
  for row, reason in enumerate(reasons):
    generated = tokens[row][response[row]]
    odd_until_last = all(t % 2 == 1 for t in generated[:-1])
    assert odd_until_last
    if reason == "stop":
      assert generated[-1] % 2 == 0 and len(generated) <= 10
      last_slot = np.nonzero(response[row])[0][-1]
      assert not response[row, last_slot + 1 :].any()
      assert (tokens[row, last_slot + 1 :] == config.pad_id).all()
      assert (np.asarray(rollout.logprobs)[row, last_slot + 1 :] == 0).all()
    else:
      assert len(generated) == 10 and generated[-1] % 2 == 1


def test_two_turn_continuation_equals_one_generation_over_the_concatenation(f32_greedy):
  observations = [[7, 7, 7], [12], [50, 51]]
  first = f32_greedy.generate(PROMPTS, jax.random.key(4))
  second = f32_greedy.continue_(first, observations, jax.random.key(5))
  turn2 = [r[8:] for r in second.responses()]
  concatenated = [p + r + o for p, r, o in zip(PROMPTS, first.responses(), observations)]
  once = f32_greedy.generate(concatenated, jax.random.key(6))
  assert once.responses() == turn2
  logp_two = np.asarray(second.logprobs)[np.asarray(second.response_mask)].reshape(3, 16)[:, 8:]
  logp_once = np.asarray(once.logprobs)[np.asarray(once.response_mask)].reshape(3, 8)
  np.testing.assert_allclose(logp_two, logp_once, rtol=1e-4, atol=1e-4)
  env = np.asarray(second.env_mask)
  np.testing.assert_array_equal(env.sum(-1), [3, 1, 2])
  for row, obs in enumerate(observations):
    assert np.asarray(second.tokens)[row][env[row]].tolist() == obs
  # An empty observation ends that episode: no new tokens for it.
  third = f32_greedy.continue_(second, [[3], [], [4]], jax.random.key(7))
  np.testing.assert_array_equal(np.asarray(third.response_mask).sum(-1), [24, 16, 24])
  # Each continuation took the cache over (donated, not copied); the earlier rollouts keep
  # their tokens, but continuing one again is refused with a clear error.
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(second.cache))
  assert np.asarray(second.tokens).shape == np.asarray(third.tokens).shape
  with pytest.raises(ValueError, match="donated"):
    f32_greedy.continue_(first, observations, jax.random.key(5))


@pytest.fixture(scope="module")
def f32_sampling(policy):
  """bf16 weights, float32 compute, sampling at T=1 with stop tokens, routing recorded."""
  config = R.RolloutConfig(
    precision="bf16",
    compute_dtype="float32",
    guidance="none",
    max_len=48,
    prompt_bucket=8,
    sampling=R.SamplingConfig(max_new_tokens=10, stop_tokens=STOPS[:8]),
  )
  return R.RolloutEngine(policy, config)


def _row(rollout, row):
  """A sequence's real tokens, its generated tokens' log-probs and its finish reason."""
  mask, response = np.asarray(rollout.mask[row]), np.asarray(rollout.response_mask[row])
  logp = np.asarray(rollout.logprobs[row])[response]
  return np.asarray(rollout.tokens[row])[mask].tolist(), logp, rollout.finish_reasons()[row]


def test_a_sequence_samples_the_same_tokens_in_any_batch(f32_sampling):
  """Sampling keyed by (key, sequence id, position): a sequence alone and the same sequence
  at another row of a batch of 5 (other prompts around it) get the same tokens and, in
  float32, the same log-probabilities; another sequence id gets other tokens."""
  key = jax.random.key(21)
  prompt = [9, 2, 44, 7, 61, 8, 30]
  alone = f32_sampling.generate([prompt], key, sequences=[17])
  batch = [[5, 17, 3], [100], [1, 2, 3, 4], prompt, [8, 8]]
  mixed = f32_sampling.generate(batch, key, sequences=[3, 4, 5, 17, 6])
  tokens, logp, finish = _row(alone, 0)
  tokens_b, logp_b, finish_b = _row(mixed, 3)
  assert tokens == tokens_b and finish == finish_b
  np.testing.assert_allclose(logp, logp_b, rtol=0, atol=1e-5)
  others = [_row(f32_sampling.generate([prompt], key, sequences=[s]), 0)[0] for s in (18, 19)]
  assert tokens not in others


def test_per_sequence_budgets_end_each_sequence_at_its_own_length(f32_sampling):
  """`max_new_tokens` per sequence: a sequence ends at its own budget (finish "length") or
  at a stop token before it; a sequence whose budget is the config's generates what it
  would without budgets. Budgets outside [1, max_new_tokens] are refused."""
  prompts = [[5, 17, 3], [9, 2, 44], [100], [1, 3]]
  key = jax.random.key(5)
  full = f32_sampling.generate(prompts, key)
  budgets = [1, 3, 10, 2]
  cut = f32_sampling.generate(prompts, key, max_new_tokens=budgets)
  lengths = np.asarray(cut.response_lengths)
  for row, budget in enumerate(budgets):
    whole = full.responses()[row]
    assert cut.responses()[row] == whole[:budget]
    stopped = whole[: lengths[row]][-1] in f32_sampling.config.sampling.stop_tokens
    assert cut.finish_reasons()[row] == ("stop" if stopped else "length")
    assert lengths[row] == min(budget, len(whole))
  assert np.asarray(cut.response_lengths)[2] == np.asarray(full.response_lengths)[2]
  for bad in ([0, 1, 1, 1], [11, 1, 1, 1], [1, 2]):
    with pytest.raises(ValueError, match="max_new_tokens must be 4 integers"):
      f32_sampling.generate(prompts, key, max_new_tokens=bad)


def test_same_key_same_rollout(fp4_compact):
  a = fp4_compact.generate(PROMPTS * 3, jax.random.key(8))
  b = fp4_compact.generate(PROMPTS * 3, jax.random.key(8))
  c = fp4_compact.generate(PROMPTS * 3, jax.random.key(9))
  jax.tree.map(np.testing.assert_array_equal, a.to_host(), b.to_host())
  assert a.responses() != c.responses()


def test_bad_input_is_rejected_before_any_work(policy, f32_greedy):
  with pytest.raises(ValueError, match="empty batch"):
    f32_greedy.generate([], jax.random.key(0))
  with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
    f32_greedy.generate([[1], []], jax.random.key(0))
  with pytest.raises(ValueError, match="max_len=64"):
    f32_greedy.generate([list(range(1, 60))], jax.random.key(0))
  with pytest.raises(ValueError, match="outside"):
    f32_greedy.generate([[1, 500]], jax.random.key(0))
  with pytest.raises(ValueError, match="guidance='partial'"):
    R.RolloutConfig(guidance="partial")
  with pytest.raises(ValueError, match="guided_layers"):
    R.RolloutEngine(policy, R.RolloutConfig(guided_layers=[0, 7]))
  with pytest.raises(ValueError, match="guided_layers='middle'"):
    R.RolloutConfig(guided_layers="middle")
  with pytest.raises(ValueError, match="stop_tokens"):
    R.RolloutEngine(policy, R.RolloutConfig(sampling=R.SamplingConfig(stop_tokens=(999,))))
  with pytest.raises(ValueError, match="bf16 rollout"):
    R.RolloutConfig(precision="bf16", guidance="compact")


@pytest.mark.slow
def test_checking_for_stops_every_n_steps_changes_nothing(policy, fp4_compact):
  """Slow (~165 s in a loaded full suite: a second engine's generate and continue_ compile).
  Checking "has every sequence stopped?" only every 4 steps (a GPU's host sync each
  time) gives the same rollout as checking every step, bit for bit in every buffer
  (tokens, log-probabilities, masks, positions, guidance, routing, captured inputs, the
  cache): sequences stop early here, so whole steps run after the last stop and must leave
  no trace; the continuation from that cache must agree too. A bad value names the field."""
  assert fp4_compact.statics.stop_every == 1  # the CPU default
  config = fp4_compact.config
  every4 = R.RolloutEngine(
    policy,
    config.replace(sampling=dataclasses.replace(config.sampling, stop_check_every=4)),
    capture_inputs=True,
  )
  runs = []
  for engine in (fp4_compact, every4):
    first = engine.generate(PROMPTS, jax.random.key(11))
    host = first.without_cache()
    runs.append((host, engine.continue_(first, [[7, 8], [], [3]], jax.random.key(12))))
  assert "stop" in runs[0][0].finish_reasons() and runs[0][0].response_lengths.max() < 10
  for a, b in zip(runs[0], runs[1]):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with pytest.raises(ValueError, match="stop_check_every=0"):
    R.SamplingConfig(stop_check_every=0)


def test_weights_fused_for_the_kernels_come_back_bit_for_bit(policy):
  """The engine's kernel layout (q|k|v and gate|up in one matrix each) holds the per-matrix
  weights' bytes: `unfuse` gives `quantize_params` back exactly (what the export writes),
  and a fused weight dequantizes as its siblings do."""
  from trace_jax.kernels import layout  # noqa: PLC0415
  from trace_jax.rollout.params import fuse_for_kernels, unfuse  # noqa: PLC0415

  packed = R.quantize_params(nnx.state(policy), M.QuantConfig())
  fused = fuse_for_kernels(packed)
  attn = fused["blocks"][0]["attn"]
  assert isinstance(attn["q_proj"].get_value(), layout.FusedWeight)
  assert isinstance(attn["v_proj"].get_value(), layout.FusedPart)
  experts = fused["blocks"][0]["moe"]["w_gate"].get_value()
  assert experts.tile is not None and experts.packed.ndim == 3
  jax.tree.map(np.testing.assert_array_equal, unfuse(fused), packed)
  sq = SiteQuantizer(M.QuantConfig(), policy.cfg.num_layers, jnp.float32)
  names = ("q_proj", "k_proj", "v_proj")
  from_fused = sq.weight_group([attn[n].get_value() for n in names], "attention")
  per_matrix = [fp4.dequantize(packed["blocks"][0]["attn"][n].get_value()) for n in names]
  jax.tree.map(np.testing.assert_array_equal, list(from_fused), per_matrix)
