"""The MoE transformer: routing, dispatch paths, masks, cache, quantization sites, training."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as G
from trace_jax import model as M
from trace_jax.model.layers import LayerInputs, RMSNorm
from trace_jax.model.moe import load_balancing_loss

FP4 = M.QuantConfig()


def _model(**overrides):
  return M.Transformer(M.tiny(**overrides), rngs=nnx.Rngs(0))


def _tokens(b=2, t=12, seed=0, vocab=128):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


@functools.lru_cache(maxsize=None)
def _jitted_forward(quant, options):
  return nnx.jit(lambda m, t, kw: m(t, quant=quant, options=options, **kw))


def run(model, tokens, quant=None, record=False, **kwargs):
  """A jitted forward, compiled once per (quant, record, shapes) across tests: (logits, the
  ModelOutput); `record` records every site in full."""
  options = M.CallOptions(recording=M.Recording(form="full" if record else "none"))
  out = _jitted_forward(quant, options)(model, tokens, kwargs)
  return out.logits, out


@pytest.fixture(scope="module")
def tiny_model():
  return _model()


def test_shapes_and_routing_in_descending_probability(tiny_model):
  tokens = _tokens()
  logits, aux = run(tiny_model, tokens)
  cfg = tiny_model.cfg
  chex.assert_shape(logits, (2, 12, cfg.vocab_size))
  assert logits.dtype == jnp.float32
  chex.assert_shape(aux.routing, (cfg.num_moe_layers, 2, 12, cfg.num_experts_per_tok))

  # Recompute layer 0's router probabilities independently and check the order.
  @nnx.jit
  def layer0_router_probs(model, tokens):
    block = model.blocks[0]
    x = model.embed.get_value()[tokens]
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    mask = M.transformer.attention_mask(jnp.ones((2, 12), bool), positions, jnp.arange(12), None)
    cos, sin = M.transformer.rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    sq = M.SiteQuantizer(None, cfg.num_layers, jnp.float32)
    inputs = LayerInputs(
      cos=cos,
      sin=sin,
      attn_mask=mask,
      valid=jnp.ones((2, 12), bool),
      start=jnp.zeros((), jnp.int32),
    )
    h = x + block.attn(block.attn_norm(x), inputs, layer=0, sq=sq)[0]
    return jax.nn.softmax(block.mlp_norm(h) @ block.moe.router.get_value(), axis=-1)

  probs = layer0_router_probs(tiny_model, tokens)
  chosen = jnp.take_along_axis(probs, aux.routing[0], axis=-1)
  assert bool(jnp.all(chosen[..., 0] >= chosen[..., 1]))
  np.testing.assert_array_equal(aux.routing[0], jax.lax.top_k(probs, 2)[1])
  assert aux.router_load.shape == (cfg.num_moe_layers, cfg.num_experts)
  np.testing.assert_allclose(aux.router_load.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("quant", [None, FP4], ids=["f32", "fp4"])
def test_grouped_and_dense_dispatch_agree(quant):
  tokens = _tokens(seed=1)
  grouped, aux_g = run(_model(dispatch="grouped"), tokens, quant=quant)
  dense, aux_d = run(_model(dispatch="dense"), tokens, quant=quant)
  np.testing.assert_array_equal(aux_g.routing, aux_d.routing)
  np.testing.assert_allclose(grouped, dense, rtol=1e-5, atol=1e-5)


def test_routing_replay_uses_the_given_experts(tiny_model):
  tokens = _tokens(seed=2)
  logits, aux = run(tiny_model, tokens)

  def replay(routing):  # routing replay travels inside the Guidance, as from a rollout
    return G.Guidance(sites={}, routing=routing.astype(jnp.int8), mode="none", layers=())

  replayed, aux_r = run(tiny_model, tokens, guidance=replay(aux.routing))
  np.testing.assert_array_equal(replayed, logits)
  other = (aux.routing + 1) % tiny_model.cfg.num_experts
  forced, aux_f = run(tiny_model, tokens, guidance=replay(other))
  np.testing.assert_array_equal(aux_f.routing, other)
  assert float(jnp.abs(forced - logits).max()) > 1e-4
  with pytest.raises(ValueError, match="routing has shape"):
    run(tiny_model, tokens, guidance=replay(aux.routing[:, :1]))


def test_padding_does_not_change_real_tokens(tiny_model):
  tokens = _tokens(b=1, t=8, seed=3)
  alone, aux_alone = run(tiny_model, tokens, quant=FP4)
  # Left-pad with 4 junk tokens: real tokens keep positions 0..7 and must be unchanged.
  junk = _tokens(b=1, t=4, seed=4)
  padded = jnp.concatenate([junk, tokens], axis=1)
  mask = jnp.arange(12)[None] >= 4
  positions = jnp.maximum(jnp.arange(12) - 4, 0)[None]
  logits, aux = run(tiny_model, padded, positions=positions, mask=mask, quant=FP4)
  np.testing.assert_allclose(logits[:, 4:], alone, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(aux.routing[:, :, 4:], aux_alone.routing)


def test_sliding_window_limits_what_a_token_sees():
  m = _model(num_layers=1, sliding_window=4)
  tokens = _tokens(b=1, t=10, seed=5)
  changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % 128)
  a, _ = run(m, tokens)
  b, _ = run(m, changed)
  np.testing.assert_array_equal(a[:, 4:], b[:, 4:])  # position 0 is out of every window >= 4
  assert float(jnp.abs(a[:, :4] - b[:, :4]).max()) > 0


@pytest.mark.parametrize("quant", [None, FP4], ids=["f32", "fp4"])
def test_cached_decoding_equals_the_full_forward(tiny_model, quant):
  b, prompt, total = 2, 6, 12
  tokens = _tokens(b=b, t=total, seed=6)
  # Sequence 1 is left-padded by 2: its real tokens start at slot 2 with position 0.
  mask = jnp.ones((b, total), bool).at[1, :2].set(False)
  positions = jnp.stack([jnp.arange(total), jnp.maximum(jnp.arange(total) - 2, 0)])
  full, aux_full = run(tiny_model, tokens, positions=positions, mask=mask, quant=quant)
  cache = M.init_cache(tiny_model.cfg, b, 16, quant=quant)
  assert cache.quantized == (quant is not None)
  step = nnx.jit(
    lambda m, t, p, k, c: (lambda o: (o.logits, o))(m(t, positions=p, mask=k, quant=quant, cache=c))
  )
  logits, aux = step(tiny_model, tokens[:, :prompt], positions[:, :prompt], mask[:, :prompt], cache)
  outs, routes = [logits], [aux.routing]
  cache = aux.cache
  for i in range(prompt, total):
    logits, aux = step(
      tiny_model, tokens[:, i : i + 1], positions[:, i : i + 1], mask[:, i : i + 1], cache
    )
    outs.append(logits)
    routes.append(aux.routing)
    cache = aux.cache
  decoded = jnp.concatenate(outs, axis=1)
  real = np.asarray(mask)
  np.testing.assert_array_equal(jnp.concatenate(routes, axis=2)[:, real], aux_full.routing[:, real])
  scale = float(jnp.abs(full).max())
  np.testing.assert_allclose(decoded[real], full[real], rtol=1e-5, atol=1e-5 * scale)
  assert int(cache.index) == total


def test_fp4_cache_holds_the_fake_quantized_keys(tiny_model):
  tokens = _tokens(b=2, t=5, seed=7)
  _, aux_full = run(tiny_model, tokens, quant=FP4, record=True)
  cache = M.init_cache(tiny_model.cfg, 2, 8, quant=FP4)
  _, aux = run(tiny_model, tokens, quant=FP4, cache=cache)
  for layer in range(tiny_model.cfg.num_layers):
    recorded = aux_full.sites[(layer, "k")]
    stored = aux.cache.k[layer]
    np.testing.assert_array_equal(stored.packed[:, :5], recorded.packed)
    np.testing.assert_array_equal(stored.scales[:, :5], recorded.scales)
    np.testing.assert_array_equal(stored.global_scale[:, :5], recorded.global_scale)
  per_token = aux.cache.bytes_per_token()
  bf16 = M.init_cache(tiny_model.cfg.replace(dtype="bfloat16"), 2, 8).bytes_per_token()
  assert per_token == pytest.approx(
    bf16 * 4.5 / 16 + 2 * 2 * 2 * 4
  )  # + f32 scale per (k|v, head, layer)


def test_recorded_sites_are_the_quantized_activations(tiny_model):
  tokens = _tokens(seed=8)
  _, aux = run(tiny_model, tokens, quant=FP4, record=True)
  sites = aux.sites
  cfg = tiny_model.cfg
  expected_sites = {"attn_in", "attn_out", "k", "v", "moe_in", "moe_mid"}
  assert set(sites) == {(layer, s) for layer in range(cfg.num_layers) for s in expected_sites}
  # Every record is fp4.quantize of that site's input, per row, bit for bit.
  recording = M.CallOptions(recording=M.Recording(form="full", inputs=True))
  aux_inputs = nnx.jit(lambda m, t: m(t, quant=FP4, options=recording))(tiny_model, tokens)
  for key, recorded in aux_inputs.sites.items():
    expected = fp4.quantize(aux_inputs.site_inputs[key], global_group="row")
    np.testing.assert_array_equal(recorded.packed, expected.packed, err_msg=str(key))
    np.testing.assert_array_equal(recorded.global_scale, expected.global_scale, err_msg=str(key))
  # Layer 0's attention input is attn_norm(embedding), computed here independently.
  x = tiny_model.embed.get_value()[tokens]
  np.testing.assert_allclose(
    aux_inputs.site_inputs[(0, "attn_in")], tiny_model.blocks[0].attn_norm(x), rtol=1e-6, atol=1e-6
  )
  chex.assert_shape(sites[(0, "k")].global_scale, (2, 12, cfg.num_kv_heads, 1))
  chex.assert_shape(
    sites[(1, "moe_mid")].packed, (2, 12, cfg.num_experts_per_tok, cfg.moe_ffn_dim // 2)
  )


def test_weights_are_quantized_per_matrix_and_per_expert(tiny_model):
  experts = tiny_model.blocks[0].moe.w_gate.get_value()  # [E, d, f]
  q = M.quantize_weight(experts, "nvfp4")
  assert q.global_scale.shape == (experts.shape[0], 1, 1)
  for e in range(experts.shape[0]):
    alone = fp4.quantize(experts[e], axis=0)
    np.testing.assert_array_equal(q.packed[e], alone.packed)
  sq = M.SiteQuantizer(FP4, 2, jnp.float32)
  np.testing.assert_array_equal(sq.weight(experts, "experts"), fp4.dequantize(q))
  off = M.SiteQuantizer(None, 2, jnp.float32)
  np.testing.assert_array_equal(off.weight(experts, "experts"), experts)


def test_fp4_changes_the_output_but_bf16_precision_is_off(tiny_model):
  tokens = _tokens(seed=9)
  base, _ = run(tiny_model, tokens)
  off, _ = run(tiny_model, tokens, quant=M.QuantConfig(precision="bf16"))
  np.testing.assert_array_equal(base, off)
  quantized, _ = run(tiny_model, tokens, quant=FP4)
  assert float(jnp.abs(quantized - base).max()) > 1e-3


def test_qk_norm_full_clip_tied_shared_expert_and_dense_layers_run():
  m = _model(
    qk_norm="full",
    clip_qkv=0.5,
    tie_embeddings=True,
    shared_expert_dim=32,
    shared_expert_gate=True,
    dense_layers=(0,),
    ffn_dim=64,
    num_layers=3,
  )
  logits, aux = run(m, _tokens(seed=10), quant=FP4, record=True)
  assert bool(jnp.all(jnp.isfinite(logits)))
  assert aux.routing.shape[0] == 2 and m.lm_head is None
  assert (0, "mlp_mid") in aux.sites and (1, "shared_mid") in aux.sites


def test_load_balancing_loss_hand_case():
  probs = jnp.asarray([[0.75, 0.25], [0.75, 0.25], [0.5, 0.5]])
  experts = jnp.asarray([[0], [0], [1]])
  # Third token is padding: f = [1, 0], P = [0.75, 0.25] -> 2 * 0.75 = 1.5.
  loss = load_balancing_loss(probs, experts, jnp.asarray([True, True, False]))
  assert float(loss) == pytest.approx(1.5)
  # Balanced: f = [0.5, 0.5], P = [0.5, 0.5] -> 2 * 0.5 = 1.0.
  loss = load_balancing_loss(jnp.full((2, 2), 0.5), jnp.asarray([[0], [1]]), jnp.ones(2, bool))
  assert float(loss) == pytest.approx(1.0)


def test_rmsnorm_matches_definition():
  x = jax.random.normal(jax.random.key(11), (3, 16)) * 5
  norm = RMSNorm(16, 1e-6)
  norm.scale.set_value(jnp.linspace(0.5, 1.5, 16))
  expected = (
    x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-6) * np.linspace(0.5, 1.5, 16)
  )
  np.testing.assert_allclose(norm(x), expected, rtol=1e-5)


@pytest.mark.parametrize("quant", [None, FP4], ids=["f32", "fp4"])
def test_jitted_train_step_learns(quant):
  m = _model()
  opt = nnx.Optimizer(m, optax.adam(3e-3), wrt=nnx.Param)
  tokens = _tokens(b=4, t=17, seed=12)

  @nnx.jit
  def step(m, opt, tokens):
    def loss_fn(m):
      aux = m(tokens[:, :-1], quant=quant)
      logits = aux.logits
      logp = jax.nn.log_softmax(logits)
      nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
      return nll + m.cfg.router_aux_loss_coef * aux.lb_loss

    loss, grads = nnx.value_and_grad(loss_fn)(m)
    opt.update(m, grads)
    return loss, grads

  first, grads = step(m, opt, tokens)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert float(jnp.abs(grads["blocks"][0]["moe"]["w_gate"].get_value()).max()) > 0
  for _ in range(15):
    loss, _ = step(m, opt, tokens)
  assert float(loss) < float(first) - 0.5


def test_forward_takes_one_config_one_guidance_and_sows_under_capture(tiny_model):
  """The call takes tokens, positions, mask, cache, one QuantConfig, one Guidance and a
  rollout engine's Skew (`model.skew`); its records come through nnx.capture: no Module.sow
  deprecation, nothing left on the model."""
  import inspect  # noqa: PLC0415
  import warnings  # noqa: PLC0415

  params = list(inspect.signature(M.Transformer.__call__).parameters)
  assert params == [
    "self",
    "tokens",
    "positions",
    "mask",
    "cache",
    "quant",
    "guidance",
    "options",
    "skew",
  ]
  options = M.CallOptions(recording=M.Recording(form="compact", layers=(1,)))
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    out = tiny_model(_tokens(seed=13), quant=FP4, options=options)  # eager: sows run in Python
  assert isinstance(out, M.ModelOutput)
  assert {layer for layer, _ in out.sites} == {1} and out.fallbacks == {} and out.site_inputs == {}
  assert all(isinstance(r, fp4.CompactGuidance) for r in out.sites.values())
  assert not nnx.state(tiny_model, nnx.Intermediate)  # the capture took them all


def test_stochastic_rounding_draws_from_the_guidance_key(tiny_model):
  """QuantConfig(rounding="stochastic") reads its PRNG key from the one guidance input:
  the same key gives the same output, another key another, and no key is refused."""
  quant = M.QuantConfig(rounding="stochastic", guided_layers="all")
  tokens = _tokens(seed=14)
  forward = nnx.jit(lambda m, t, g: m(t, quant=quant, guidance=g).logits)
  a = forward(tiny_model, tokens, G.Guidance.of_key(jax.random.key(1)))
  again = forward(tiny_model, tokens, G.Guidance.of_key(jax.random.key(1)))
  other = forward(tiny_model, tokens, G.Guidance.of_key(jax.random.key(2)))
  nearest, _ = run(tiny_model, tokens, quant=FP4)
  np.testing.assert_array_equal(a, again)
  assert float(jnp.abs(a - other).max()) > 0 and float(jnp.abs(a - nearest).max()) > 0
  with pytest.raises(ValueError, match="needs a key"):
    tiny_model(tokens, quant=quant)


@pytest.mark.parametrize("quant", [None, FP4])
def test_last_logits_are_the_last_slot_of_the_full_head(tiny_model, quant):
  """`CallOptions.last_logits`: logits [B, 1, V], bit for bit the last slot's row of the full
  head's [B, T, V], and everything else the call returns unchanged."""
  seed = int(np.random.default_rng().integers(1 << 30))
  tokens = _tokens(b=3, t=10, seed=seed)
  full = _jitted_forward(quant, M.CallOptions())(tiny_model, tokens, {})
  last = _jitted_forward(quant, M.CallOptions(last_logits=True))(tiny_model, tokens, {})
  assert last.logits.shape == (3, 1, full.logits.shape[-1])
  np.testing.assert_array_equal(np.asarray(last.logits), np.asarray(full.logits[:, -1:]))
  np.testing.assert_array_equal(np.asarray(last.routing), np.asarray(full.routing))


def test_last_logits_must_be_a_bool():
  with pytest.raises(ValueError, match="last_logits"):
    M.CallOptions(last_logits=1)
