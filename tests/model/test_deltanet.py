"""Gated DeltaNet: the delta rule against a float64 NumPy loop of its definition, chunked ==
recurrent, masked tokens leave conv and state untouched, prefill + decode == full forward."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.model import deltanet
from trace_jax.model.config import hybrid_layer_types


def _inputs(seed, b=2, t=13, h=3, dk=8, dv=5):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = deltanet._l2norm(jax.random.normal(keys[0], (b, t, h, dk))) * dk**-0.5
  k = deltanet._l2norm(jax.random.normal(keys[1], (b, t, h, dk)))
  v = jax.random.normal(keys[2], (b, t, h, dv))
  g = -jax.nn.softplus(jax.random.normal(keys[3], (b, t, h)))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
  state = jax.random.normal(keys[5], (b, h, dk, dv))
  return q, k, v, g, beta, state


def _numpy_delta_rule(q, k, v, g, beta, state):
  """The definition, token by token, in float64 (DESIGN / Hugging Face's recurrent form)."""
  q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
  out = np.zeros(v.shape)
  for t in range(q.shape[1]):
    s = s * np.exp(g[:, t])[..., None, None]
    memory = np.einsum("bhkv,bhk->bhv", s, k[:, t])
    s = s + np.einsum("bhk,bhv->bhkv", k[:, t], (v[:, t] - memory) * beta[:, t][..., None])
    out[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
  return out, s


def test_recurrent_form_matches_the_definition():
  args = _inputs(0)
  out, state = jax.jit(deltanet.recurrent_delta_rule)(*args)
  ref_out, ref_state = _numpy_delta_rule(*args)
  np.testing.assert_allclose(out, ref_out, atol=2e-5)
  np.testing.assert_allclose(state, ref_state, atol=2e-5)


@pytest.mark.parametrize("t, chunk", [(13, 4), (13, 5), (29, 8), (7, 16), (16, 16), (33, 1)])
def test_chunked_equals_recurrent(t, chunk):
  args = _inputs(t * 100 + chunk, t=t)
  out, state = jax.jit(deltanet.chunked_delta_rule, static_argnums=6)(*args, chunk)
  ref_out, ref_state = _numpy_delta_rule(*args)
  chex.assert_shape(out, args[2].shape)
  np.testing.assert_allclose(out, ref_out, atol=5e-5)
  np.testing.assert_allclose(state, ref_state, atol=5e-5)


def test_masked_tokens_leave_state_unchanged():
  """g = beta = 0 at a token: the outputs at the other tokens equal those of the sequence
  without it (the mask's contract), in both forms."""
  q, k, v, g, beta, state = _inputs(3, t=12)
  keep = np.array([True] * 3 + [False] * 2 + [True] * 5 + [False] + [True])
  gm, bm = (jnp.where(jnp.asarray(keep)[None, :, None], a, 0.0) for a in (g, beta))
  ref_out, ref_state = _numpy_delta_rule(*(a[:, keep] for a in (q, k, v, g, beta)), state)
  for out, final in (
    deltanet.recurrent_delta_rule(q, k, v, gm, bm, state),
    deltanet.chunked_delta_rule(q, k, v, gm, bm, state, 4),
  ):
    np.testing.assert_allclose(np.asarray(out)[:, keep], ref_out, atol=5e-5)
    np.testing.assert_allclose(final, ref_state, atol=5e-5)


def _numpy_conv(x, weight, state):
  """Depthwise causal conv of the valid tokens (rows of x), continuing from `state`."""
  full = np.concatenate([state, x], axis=0)
  width = weight.shape[0]
  out = np.stack(
    [
      sum(weight[width - 1 - j] * full[i - j] for j in range(width))
      for i in range(width - 1, full.shape[0])
    ]
  )
  return out, full[-(width - 1) :]


def test_causal_conv_skips_holes_and_carries_state():
  keys = jax.random.split(jax.random.key(4), 3)
  x = jax.random.normal(keys[0], (2, 9, 6))
  weight = jax.random.normal(keys[1], (4, 6))
  state = jax.random.normal(keys[2], (2, 3, 6))
  valid = np.ones((2, 9), bool)
  valid[0, :3] = False  # left padding
  valid[1, [2, 5, 6]] = False  # holes
  out, new_state = jax.jit(deltanet.causal_conv)(x, weight, state, jnp.asarray(valid))
  for b in range(2):
    ref, ref_state = _numpy_conv(
      np.asarray(x[b])[valid[b]], np.asarray(weight), np.asarray(state[b])
    )
    np.testing.assert_allclose(np.asarray(out[b])[valid[b]], ref, atol=1e-5)
    np.testing.assert_allclose(new_state[b], ref_state, atol=1e-6)


# --- The hybrid model: prefill + decode through the cache == one full forward ---------------


@functools.lru_cache(maxsize=None)
def _tiny():
  """qwen3_5_tiny cut to one Gated DeltaNet layer and one gated full-attention layer: both
  kinds of cache entry at half the compile time of the 4-layer preset."""
  cfg = M.get_preset(
    "qwen3_5_tiny", num_layers=2, layer_types=("linear_attention", "full_attention")
  )
  return M.Transformer(cfg, rngs=nnx.Rngs(1))


@functools.lru_cache(maxsize=None)
def _step(quant):
  return nnx.jit(
    lambda m, t, p, mask, c: (lambda o: (o.logits, o))(
      m(t, positions=p, mask=mask, cache=c, quant=quant)
    )
  )


@pytest.mark.parametrize("fp4", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_prefill_then_decode_equals_full_forward(fp4):
  """Left-padded prompts, then decode steps where one sequence writes an invalid slot (a hole):
  every valid slot's logits equal those of one forward over the whole buffer."""
  model, quant = _tiny(), (M.QuantConfig() if fp4 else None)
  cfg = model.cfg
  b, prompt_len, steps = 2, 11, 6
  tokens = jax.random.randint(jax.random.key(5), (b, prompt_len + steps), 0, cfg.vocab_size)
  mask = np.ones((b, prompt_len + steps), bool)
  mask[1, :4] = False  # left padding of the second prompt
  mask[0, prompt_len + 2] = False  # a hole during decode
  mask = jnp.asarray(mask)
  positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
  cache = M.init_cache(cfg, b, 32, quant)
  assert cache.k[0] is None and cache.recurrent[0].shape == (b, 4, 16, 16)
  assert cache.k[1] is not None and cache.recurrent[1] is None
  assert cache.quantized == fp4
  logits, aux = _step(quant)(
    model, tokens[:, :prompt_len], positions[:, :prompt_len], mask[:, :prompt_len], cache
  )
  pieces = [logits]
  cache = aux.cache
  for i in range(prompt_len, prompt_len + steps):
    logits, aux = _step(quant)(
      model, tokens[:, i : i + 1], positions[:, i : i + 1], mask[:, i : i + 1], cache
    )
    pieces.append(logits)
    cache = aux.cache
  incremental = jnp.concatenate(pieces, axis=1)
  full = nnx.jit(lambda m, t, p, mask: m(t, positions=p, mask=mask, quant=quant).logits)(
    model, tokens, positions, mask
  )
  valid = np.asarray(mask)
  np.testing.assert_allclose(
    np.asarray(incremental)[valid], np.asarray(full)[valid], atol=2e-4 if fp4 else 2e-5
  )
  assert int(cache.index) == prompt_len + steps


def test_cache_fields_read_per_layer_from_their_stacks():
  """Each cache field is one stack over the layers of its kind (`LayerEntries`) that reads
  like a tuple over every layer: entry i is layer i's slice, None at a layer of the other
  kind, negative indices count from the end, and reading past the depth is an IndexError."""
  cfg = M.qwen3_5_tiny(num_layers=8, layer_types=hybrid_layer_types(8))
  linear = sorted(cfg.linear_layers)
  attention = [i for i in range(cfg.num_layers) if i not in linear]
  cache = M.init_cache(cfg, 2, 16, M.QuantConfig())
  rng = np.random.default_rng()
  stack = rng.standard_normal(cache.recurrent.stack.shape).astype(np.float32)
  recurrent = cache.recurrent.with_stack(jnp.asarray(stack))
  assert cache.k.layers == tuple(attention) and recurrent.layers == tuple(linear)
  assert len(cache.k) == len(recurrent) == cfg.num_layers
  for layer in range(cfg.num_layers):
    assert (cache.k[layer] is None) == (layer in linear) == (recurrent[layer] is not None)
    if layer in linear:
      np.testing.assert_array_equal(recurrent[layer], stack[linear.index(layer)])
    else:
      assert cache.k[layer].packed.shape == (2, 16, cfg.num_kv_heads, cfg.head_dim // 2)
  np.testing.assert_array_equal(recurrent[linear[-1] - cfg.num_layers], stack[-1])
  assert [e is None for e in cache.v] == [i in linear for i in range(cfg.num_layers)]
  with pytest.raises(IndexError):
    cache.k[cfg.num_layers]
