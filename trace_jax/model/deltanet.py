"""Gated DeltaNet linear attention (Qwen3.5's linear layers): conv1d, gated delta rule, norm.

Per value head h, with a state S [Dk, Dv] and for each token t (Hugging Face's
`torch_recurrent_gated_delta_rule`, the definition everything here is tested against):
  1. S <- exp(g_t) * S                          (g_t <= 0: per-head decay, in log space)
  2. S <- S + k_t (beta_t * (v_t - S^T k_t))^T  (the delta rule: write the correction)
  3. o_t = S^T q_t
with q, k L2-normalised and q scaled by Dk^-1/2. Two forms compute the same function:
  recurrent  a `lax.scan` over tokens (decode: one token over the cached state);
  chunked    the standard parallel form (training and prefill): within a chunk of C tokens
             the C updates collapse, through a unit lower-triangular solve (the UT / WY
             transform), into matmuls, and a `lax.scan` carries the state across chunks.
A token whose mask is False leaves the state untouched (g = 0, beta = 0) and does not
enter the causal conv1d, so padding and holes in a rollout buffer never shift a sequence's
state: the training path over [B, S] buffers equals prefill + decode over the same slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.model.config import ModelConfig
from trace_jax.model.layers import LayerInputs, RMSNorm
from trace_jax.model.parameters import normal_param, param, param_key
from trace_jax.model.quantizer import SiteQuantizer
from trace_jax.model.sites import ATTN_IN, ATTN_OUT, sow_site

_HIGHEST = jax.lax.Precision.HIGHEST


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x * rsqrt(sum(x^2) + eps) over the last axis (Hugging Face / FLA's l2norm)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def recurrent_delta_rule(q, k, v, g, beta, state):
  """The gated delta rule token by token.

  Args:
    q, k: float32 [B, T, H, Dk] (normalised and scaled).
    v: float32 [B, T, H, Dv].
    g, beta: float32 [B, T, H] log-decay (<= 0) and write strength.
    state: float32 [B, H, Dk, Dv].

  Returns:
    (o [B, T, H, Dv], final state [B, H, Dk, Dv]).
  """

  def step(s, inputs):
    q_t, k_t, v_t, g_t, b_t = inputs  # [B, H, D], [B, H]
    s = s * jnp.exp(g_t)[..., None, None]
    memory = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=_HIGHEST)
    delta = (v_t - memory) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=_HIGHEST)

  time_major = [jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)]
  state, out = jax.lax.scan(step, state, time_major)
  return jnp.moveaxis(out, 0, 1), state


def chunked_delta_rule(q, k, v, g, beta, state, chunk_size: int):
  """The gated delta rule in its chunked parallel form (same arguments and result as
  `recurrent_delta_rule`). Within chunk c, with G the in-chunk cumulative log-decay:
    1. D_ij = exp(G_i - G_j) for j <= i (0 above the diagonal);
    2. solve (I + strictly_lower(beta_i k_i.k_j D_ij)) [U | W] = [beta v | beta k exp(G)];
    3. scan over chunks: V' = U - W S;  o = (q exp(G)) S + (q k^T * D) V';
       S <- exp(G_last) S + (k exp(G_last - G))^T V'.
  The length is padded to a multiple of the chunk with g = beta = 0 (no effect on S).
  """
  b, t, h, dk = k.shape
  dv = v.shape[-1]
  pad = (-t) % chunk_size
  if pad:
    widths = lambda a: [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)
    q, k, v, g, beta = (jnp.pad(a, widths(a)) for a in (q, k, v, g, beta))
  n = (t + pad) // chunk_size

  def chunks(a):  # [B, N*C, H, ...] -> [B, H, N, C, ...]
    a = a.reshape(b, n, chunk_size, h, *a.shape[3:])
    return jnp.moveaxis(a, 3, 1)

  q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
  cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
  lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
  diff = jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf)
  decay = jnp.exp(diff)  # [B, H, N, C, C], 0 above the diagonal
  k_beta = k * beta[..., None]
  system = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=_HIGHEST) * decay
  system = jnp.where(jnp.tril(lower, -1), system, 0.0) + jnp.eye(chunk_size, dtype=k.dtype)
  rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
  solved = jax.lax.linalg.triangular_solve(
    system, rhs, left_side=True, lower=True, unit_diagonal=True
  )
  new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]
  intra = jnp.einsum("...id,...jd->...ij", q, k, precision=_HIGHEST) * decay
  q_decayed = q * jnp.exp(cum)[..., None]
  k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
  chunk_decay = jnp.exp(cum[..., -1])  # [B, H, N]

  def step(s, inputs):
    u, w, qd, kd, attn, cd = inputs  # [B, H, C, .], ..., [B, H, C, C], [B, H]
    v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s, precision=_HIGHEST)
    out = jnp.einsum("bhck,bhkv->bhcv", qd, s, precision=_HIGHEST) + jnp.einsum(
      "bhij,bhjv->bhiv", attn, v_new, precision=_HIGHEST
    )
    s = s * cd[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd, v_new, precision=_HIGHEST)
    return s, out

  per_chunk = [
    jnp.moveaxis(a, 2, 0)
    for a in (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay)
  ]
  state, out = jax.lax.scan(step, state, per_chunk)  # out [N, B, H, C, Dv]
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk_size, dv)
  return jnp.moveaxis(out, 1, 2)[:, :t], state


def causal_conv(x: jax.Array, weight: jax.Array, state: jax.Array, valid: jax.Array):
  """Depthwise causal conv1d over the valid tokens only, continuing from `state`.

  out_t = sum_j weight[K-1-j] * x_(j-th valid token before t, t itself at j = 0), where the
  tokens before the chunk come from `state`: a padding slot or hole neither enters a window
  nor advances the state (Hugging Face's conv over an unpadded sequence, zeros before it).

  Args:
    x: [B, T, C]; weight [K, C]; state [B, K-1, C] (the last K-1 valid inputs, oldest
      first; zeros at the start); valid bool [B, T].

  Returns:
    (out [B, T, C] in x's dtype (invalid slots hold junk), new state [B, K-1, C]).
  """
  width = weight.shape[0]
  full = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
  full_valid = jnp.concatenate([jnp.ones(state.shape[:2], bool), valid], axis=1)
  order = jnp.argsort(~full_valid, axis=1, stable=True)  # valid slots first, in order
  packed = jnp.take_along_axis(full, order[..., None], axis=1)
  rank = jnp.cumsum(full_valid, axis=1, dtype=jnp.int32)[:, width - 1 :] - 1  # [B, T]
  out = jnp.zeros(x.shape, jnp.float32)
  for j in range(width):  # j tokens back
    taps = jnp.take_along_axis(packed, jnp.maximum(rank - j, 0)[..., None], axis=1)
    out = out + taps.astype(jnp.float32) * weight[width - 1 - j].astype(jnp.float32)
  count = jnp.sum(full_valid, axis=1, dtype=jnp.int32)  # >= K-1
  last = count[:, None] - (width - 1) + jnp.arange(width - 1, dtype=jnp.int32)
  new_state = jnp.take_along_axis(packed, last[..., None], axis=1)
  return out.astype(x.dtype), new_state


class GatedDeltaNet(nnx.Module):
  """One Gated DeltaNet layer; quantization sites attn_in (input of the in-projections)
  and attn_out (input of out_proj). The decay/beta projections (in_proj_a, in_proj_b), the
  conv, A_log, dt_bias and the norm stay in high precision, like the router."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    self.dims = (hk, hv, dk, dv)
    self.conv_dim = 2 * hk * dk + hv * dv  # [q | k | v]
    std = cfg.init_std
    # The token mixer's FP4 projections (group "attention"). in_proj_qkv's columns are
    # [q | k | v] (the conv runs over all of them), so only its rows are split (FSDP); z and
    # out_proj are per value head, split over "model" by whole heads.
    mixer = dict(quant_group="attention", input_site=ATTN_IN)
    self.in_proj_qkv = normal_param(rngs, (d, self.conv_dim), std, sharding=("data", None), **mixer)
    self.in_proj_z = normal_param(
      rngs, (d, hv * dv), std, sharding=("data", "model"), heads=hv, **mixer
    )
    # Decay and write strength: high precision, like the router.
    self.in_proj_b = normal_param(rngs, (d, hv), std, sharding=("data", None))
    self.in_proj_a = normal_param(rngs, (d, hv), std, sharding=("data", None))
    self.conv_weight = normal_param(
      rngs,
      (cfg.linear_conv_kernel, self.conv_dim),
      cfg.linear_conv_kernel**-0.5,
      sharding=(None, None),
    )
    self.A_log = param(
      jnp.log(jax.random.uniform(param_key(rngs), (hv,), jnp.float32, 1.0, 16.0)), sharding=(None,)
    )
    self.dt_bias = param(jnp.ones((hv,), jnp.float32), sharding=(None,))
    self.norm = RMSNorm(dv, cfg.rms_eps)  # plain w (not 1 + w), as Hugging Face's gated norm
    self.out_proj = normal_param(
      rngs,
      (hv * dv, d),
      std,
      sharding=("model", "data"),
      heads=hv,
      quant_group="attention",
      input_site=ATTN_OUT,
    )
    self.chunk_size = cfg.delta_chunk_size

  def init_state(self, batch: int, dtype) -> tuple[jax.Array, jax.Array]:
    """(conv state [B, K-1, conv_dim] in `dtype`, recurrent state [B, Hv, Dk, Dv] float32)."""
    hk, hv, dk, dv = self.dims
    width = self.conv_weight.get_value().shape[0]
    return (
      jnp.zeros((batch, width - 1, self.conv_dim), dtype),
      jnp.zeros((batch, hv, dk, dv), jnp.float32),
    )

  def __call__(self, x, inputs: LayerInputs, *, layer: int, sq: SiteQuantizer, state=None):
    """x [B, T, d] (normed), `inputs.valid` bool [B, T]; state (conv, recurrent) to continue
    from.

    Returns (out [B, T, d], new (conv, recurrent) state, or None without a state).
    """
    b, t, _ = x.shape
    hk, hv, dk, dv = self.dims
    valid = inputs.valid
    x = jnp.where(valid[..., None], x, 0)
    xq = sow_site(self, sq, x, layer=layer, site=ATTN_IN)
    qkv = sq.matmul(xq, self.in_proj_qkv.get_value(), self.in_proj_qkv.quant_group)
    z = sq.matmul(xq, self.in_proj_z.get_value(), self.in_proj_z.quant_group)
    # Decay and write strength from high-precision projections of the unquantized input.
    a = jnp.einsum(
      "btd,dh->bth", x.astype(jnp.float32), self.in_proj_a.get_value(), precision=_HIGHEST
    )
    beta_logit = jnp.einsum(
      "btd,dh->bth", x.astype(jnp.float32), self.in_proj_b.get_value(), precision=_HIGHEST
    )
    conv_state, recurrent = state if state is not None else self.init_state(b, x.dtype)
    qkv, new_conv = causal_conv(qkv, self.conv_weight.get_value(), conv_state, valid)
    qkv = jax.nn.silu(qkv).astype(jnp.float32)
    q, k, v = jnp.split(qkv, [hk * dk, 2 * hk * dk], axis=-1)
    q, k = (_l2norm(a_.reshape(b, t, hk, dk)) for a_ in (q, k))
    q = q * dk**-0.5
    q, k = (jnp.repeat(a_, hv // hk, axis=2) for a_ in (q, k))  # value head h -> key head h // r
    v = v.reshape(b, t, hv, dv)
    g = -jnp.exp(self.A_log.get_value()) * jax.nn.softplus(a + self.dt_bias.get_value())
    g = jnp.where(valid[..., None], g, 0.0)
    beta = jnp.where(valid[..., None], jax.nn.sigmoid(beta_logit), 0.0)
    if state is not None and t == 1:  # a decode step: the recurrent form
      core, recurrent = recurrent_delta_rule(q, k, v, g, beta, recurrent)
    else:
      core, recurrent = chunked_delta_rule(q, k, v, g, beta, recurrent, self.chunk_size)
    # Gated RMSNorm per value head: w * norm(o) (in x's dtype), times silu(z) in float32.
    normed = self.norm(core.astype(x.dtype))
    z = z.reshape(b, t, hv, dv).astype(jnp.float32)
    out = (normed.astype(jnp.float32) * jax.nn.silu(z)).astype(x.dtype).reshape(b, t, hv * dv)
    out = sow_site(self, sq, out, layer=layer, site=ATTN_OUT)
    out = sq.matmul(out, self.out_proj.get_value(), self.out_proj.quant_group)
    return out, (None if state is None else (new_conv, recurrent))
