"""Next-token sampling: temperature, top-k, top-p (nucleus), greedy; and its log-probabilities."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.rollout.config import SamplingConfig

_NEG_INF = -jnp.inf


def filter_logits(scaled: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Set to -inf every logit outside the top-k and outside the nucleus (top-p).

  The nucleus is the smallest set of most likely tokens whose probability reaches top_p;
  the most likely token is always kept. Tokens tied with the last kept one stay too.

  Args:
    scaled: float32 [B, V] logits already divided by the temperature.
  """
  filtered = scaled
  if top_k and top_k < scaled.shape[-1]:
    kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
    filtered = jnp.where(scaled < kth, _NEG_INF, filtered)
  if top_p < 1.0:
    sorted_logits = jnp.sort(filtered, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p  # the first token always has mass_before 0
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    filtered = jnp.where(filtered < threshold, _NEG_INF, filtered)
  return filtered


def sequence_keys(key: jax.Array, sequences: jax.Array, positions: jax.Array) -> jax.Array:
  """Each row's sampling key: fold_in(fold_in(key, sequence id), position), keys [B].

  A token's draw then depends on the call's key, its sequence and its place in that
  sequence only: not on the row it occupies, its neighbours or the batch size (the slot
  pool decodes a sequence in any slot and gives it the static batch's tokens).

  Args:
    key: the call's key (a scalar key).
    sequences: uint32 [B] sequence ids.
    positions: int32 [B] the RoPE position the drawn token will take.
  """
  fold = lambda s, p: jax.random.fold_in(jax.random.fold_in(key, s), p)  # noqa: E731
  return jax.vmap(fold)(sequences.astype(jnp.uint32), positions.astype(jnp.uint32))


def sample(logits: jax.Array, key: jax.Array, sampling: SamplingConfig):
  """Draw one token per row.

  Args:
    logits: float32 [B, V].
    key: one key for the batch, or keys [B] (one per row: `sequence_keys`), each row's
      draw then made with its own key alone.

  Returns:
    tokens int32 [B]; logprobs [B] under softmax(logits / T) (T = 1 if greedy);
    sampling_logprobs [B] under the distribution actually sampled (after top-k / top-p;
    0 for greedy).
  """
  logits = logits.astype(jnp.float32)
  if sampling.greedy:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, None], -1)[:, 0]
    return tokens, logp, jnp.zeros_like(logp)
  scaled = logits / sampling.temperature
  filtered = filter_logits(scaled, sampling.top_k, sampling.top_p)
  if key.ndim:  # a key per row
    draw = lambda k, row: jax.random.categorical(k, row, axis=-1)  # noqa: E731
    tokens = jax.vmap(draw)(key, filtered).astype(jnp.int32)
  else:
    tokens = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
  logp = jnp.take_along_axis(jax.nn.log_softmax(scaled), tokens[:, None], -1)[:, 0]
  sampling_logp = jnp.take_along_axis(jax.nn.log_softmax(filtered), tokens[:, None], -1)[:, 0]
  return tokens, logp, sampling_logp
