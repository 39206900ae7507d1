"""The policy model: a decoder-only MoE transformer in Flax NNX.

Calling convention (a contract with the rollout and training paths):

  logits, aux = model(tokens, positions=..., mask=..., quant=..., cache=..., guidance=...,
                      record=...)

logits are float32 [B, T, V]; aux["routing"] is int32 [num_moe_layers, B, T, k] with each
token's experts in descending router probability; aux also holds "lb_loss" (mean over MoE
layers), "router_load" [num_moe_layers, E], "router_entropy", and, when asked, "cache" (the
updated cache: K/V at attention layers, conv and recurrent states at Gated DeltaNet
layers), "sites" ({(layer, site): fp4.QArray} of every quantized activation) and
"fallbacks" ({(layer, site): bool mask} of guidance fallbacks at guided sites).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.guidance import Guidance
from trace_jax.model.attention import Attention
from trace_jax.model.cache import KVCache
from trace_jax.model.config import ModelConfig
from trace_jax.model.deltanet import GatedDeltaNet
from trace_jax.model.layers import RMSNorm, normal_param, rope_tables
from trace_jax.model.moe import MLP, MoE
from trace_jax.model.quant import QuantConfig, Recording, SiteQuantizer, collect_site_records, sow_site


class Block(nnx.Module):
  """Pre-norm residual block: attention (softmax, or Gated DeltaNet at the linear layers of
  a hybrid model), then an MoE (or dense) feed-forward."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.zero_centered_norm)
    self.linear = layer in cfg.linear_layers
    self.attn = GatedDeltaNet(cfg, rngs=rngs) if self.linear else Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.zero_centered_norm)
    if layer in cfg.dense_layers:
      self.mlp, self.moe = MLP(cfg.d_model, cfg.ffn_dim, cfg.init_std, rngs=rngs), None
    else:
      self.mlp, self.moe = None, MoE(cfg, rngs=rngs)
    self.layer = layer

  def __call__(self, x, cos, sin, attn_mask, valid, sq, cache=None, index=None, routing=None):
    if self.linear:  # cache: (conv, recurrent) state; entries: the updated state
      attn_out, entries = self.attn(self.attn_norm(x), valid, self.layer, sq, cache)
    else:
      attn_out, entries = self.attn(self.attn_norm(x), cos, sin, attn_mask, self.layer, sq,
                                    cache, index)
    x = x + attn_out
    h = self.mlp_norm(x)
    if self.moe is not None:
      out, stats = self.moe(h, valid, self.layer, sq, routing)
    else:
      xq = sow_site(self, sq, h, self.layer, "mlp_in")
      out, stats = self.mlp(xq, self.layer, sq, "mlp_mid"), None
    return x + out, entries, stats


def attention_mask(valid_keys, query_slots, key_slots, window: int | None) -> jax.Array:
  """bool [B, T, S]: key s is a real token, not after query t, and within the window."""
  causal = key_slots[None, None, :] <= query_slots[:, :, None]
  if window is not None:
    causal &= key_slots[None, None, :] > query_slots[:, :, None] - window
  return valid_keys[:, None, :] & causal


def check_token_ids(tokens, vocab_size: int, what: str = "tokens") -> None:
  """Refuse token ids outside [0, vocab_size) where they are concrete (eager calls).

  Under jit the ids are traced and cannot be read without a device-to-host round trip
  (and a `checkify` check would force every caller to wrap its function); there
  `embed_tokens` turns such ids into NaN embeddings instead, so the fault stays visible.
  The public entry points that take host data (the eager model call, `training_forward`,
  `RolloutEngine.generate` / `continue_`) refuse them here, before any work.
  """
  try:
    ids = np.asarray(tokens)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return  # traced: embed_tokens makes bad ids NaN
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{what} must be integer token ids; got dtype {ids.dtype}")
  bad = (ids < 0) | (ids >= vocab_size)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{what} hold token ids {np.unique(ids[bad])[:5].tolist()} outside the "
                     f"vocabulary [0, {vocab_size}) (first at index {first})")


def embed_tokens(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """Rows of the embedding table; an id outside [0, V) gives a NaN row, never another
  token's row (jnp.take would wrap negative ids around)."""
  vocab = table.shape[0]
  tokens = jnp.where(tokens < 0, vocab, tokens)
  return jnp.take(table, tokens, axis=0, mode="fill", fill_value=jnp.nan)


def _rematerialized(block: Block):
  """`block`'s call under `nnx.remat` (jax.checkpoint): the backward pass recomputes the
  block's activations from its input instead of keeping them (ModelConfig.remat). Only for
  calls without a cache or recorded sites: those return values made inside the block."""

  def call(x, cos, sin, attn_mask, valid, sq, cache, index, routing):
    del cache
    inner = lambda blk, x, cos, sin, attn_mask, valid, routing: blk(
        x, cos, sin, attn_mask, valid, sq, None, index, routing)
    return nnx.remat(inner)(block, x, cos, sin, attn_mask, valid, routing)

  return call


class Transformer(nnx.Module):
  """Embedding, `num_layers` blocks, final RMSNorm and LM head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std)
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.zero_centered_norm)
    self.lm_head = (None if cfg.tie_embeddings
                    else normal_param(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std))

  def __call__(
      self,
      tokens: jax.Array,
      *,
      positions: jax.Array | None = None,
      mask: jax.Array | None = None,
      quant: QuantConfig | None = None,
      cache: KVCache | None = None,
      guidance: Guidance | None = None,
      record: bool | Recording = False,
      record_inputs: bool = False,
      key: jax.Array | None = None,
      dtype=None,
      kernels: str = "xla",
  ) -> tuple[jax.Array, dict]:
    """Forward over tokens [B, T].

    Args:
      tokens: int [B, T].
      positions: int [B, T] RoPE positions; default the slot index (0.. T-1, or continuing
        the cache).
      mask: bool [B, T], False for padding; default all True.
      quant: FP4 quantization (training path: fake-quantized master weights; rollout path:
        params made by `quantize_params`). None or precision "bf16": off.
      cache: a KVCache to write slots [cache.index, cache.index + T) into and attend over.
      guidance: the rollout's `Guidance`, the model's one guidance input: its sites drive
        quant.rounding == "guided" (needs rounding "guided" when it holds any), and its
        routing, if any, int [num_moe_layers, B, T, k], is replayed instead of routing.
      record: a `Recording` (which layers, in which guidance form, inputs too), or True
        for every site's `fp4.QArray`; returned as aux["sites"] (and aux["fallbacks"] of
        guided sites, aux["site_inputs"] when inputs are recorded).
      record_inputs: with record=True/False: also record the inputs, before quantization.
      key: PRNG key for stochastic rounding.
      dtype: compute dtype for this call (default cfg.dtype), e.g. bf16 for a rollout of a
        float32-configured policy.
      kernels: "xla", "pallas" or "auto" (Pallas on GPU): whether packed FP4 weights and
        the FP4 cache go through `trace_jax.kernels` (forward only: the rollout path).
    """
    cfg = self.cfg
    check_token_ids(tokens, cfg.vocab_size)
    dtype = cfg.compute_dtype if dtype is None else jnp.dtype(dtype)
    b, t = tokens.shape
    if mask is None:
      mask = jnp.ones((b, t), bool)
    start = jnp.zeros((), jnp.int32) if cache is None else cache.index
    slots = start + jnp.arange(t, dtype=jnp.int32)
    if positions is None:
      positions = jnp.broadcast_to(slots, (b, t))
    if guidance is not None and not isinstance(guidance, Guidance):
      raise ValueError(f"guidance must be a trace_jax.guidance.Guidance, got "
                       f"{type(guidance).__name__}")
    routing = None if guidance is None else guidance.routing
    if routing is not None and routing.shape[:3] != (cfg.num_moe_layers, b, t):
      raise ValueError(f"routing has shape {routing.shape}; expected "
                       f"({cfg.num_moe_layers}, {b}, {t}, {cfg.num_experts_per_tok})")
    recording = record if isinstance(record, Recording) else Recording(
        form="full" if record else "none", inputs=record_inputs)
    sq = SiteQuantizer(quant, cfg.num_layers, dtype,
                       guidance=None if guidance is None else guidance.sites, recording=recording,
                       key=key, kernels=kernels)
    cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
    if cache is None:
      attn_mask = attention_mask(mask, jnp.broadcast_to(slots, (b, t)), slots, cfg.sliding_window)
      valid_cache = None
    else:
      valid_cache = jax.lax.dynamic_update_slice_in_dim(cache.valid, mask, start, axis=1)
      key_slots = jnp.arange(cache.max_len, dtype=jnp.int32)
      attn_mask = attention_mask(valid_cache, jnp.broadcast_to(slots, (b, t)), key_slots,
                                 cfg.sliding_window)

    x = embed_tokens(self.embed.get_value(), tokens).astype(dtype)
    new_k, new_v, new_conv, new_recurrent, moe_stats = [], [], [], [], []
    for block in self.blocks:
      i = block.layer
      layer_cache = None
      if cache is not None:
        layer_cache = (cache.conv[i], cache.recurrent[i]) if block.linear else (cache.k[i], cache.v[i])
      layer_routing = None
      if routing is not None and block.moe is not None:
        layer_routing = routing[len(moe_stats)]
      call = block
      if cfg.remat and cache is None and not recording.enabled:
        call = _rematerialized(block)
      x, entries, stats = call(x, cos, sin, attn_mask, mask, sq, layer_cache, start,
                               layer_routing)
      if entries is not None:
        kv, states = ((None, None), entries) if block.linear else (entries, (None, None))
        new_k.append(kv[0])
        new_v.append(kv[1])
        new_conv.append(states[0])
        new_recurrent.append(states[1])
      if stats is not None:
        moe_stats.append(stats)
    # Final norm and LM head in float32: the log-probabilities RL needs are read here.
    h = self.final_norm(x).astype(jnp.float32)
    head = self.embed.get_value().T if self.lm_head is None else self.lm_head.get_value()
    logits = jnp.einsum("btd,dv->btv", h, head, precision=jax.lax.Precision.HIGHEST)

    aux: dict = {}
    if moe_stats:
      aux["routing"] = jnp.stack([s["experts"] for s in moe_stats])
      aux["lb_loss"] = jnp.mean(jnp.stack([s["lb_loss"] for s in moe_stats]))
      aux["router_load"] = jnp.stack([s["load"] for s in moe_stats])
    else:
      aux["routing"] = jnp.zeros((0, b, t, cfg.num_experts_per_tok), jnp.int32)
      aux["lb_loss"] = jnp.zeros((), jnp.float32)
      aux["router_load"] = jnp.zeros((0, cfg.num_experts), jnp.float32)
    if cache is not None:
      hybrid = bool(cfg.linear_layers)
      aux["cache"] = KVCache(k=tuple(new_k), v=tuple(new_v), valid=valid_cache,
                             index=start + t, conv=tuple(new_conv) if hybrid else (),
                             recurrent=tuple(new_recurrent) if hybrid else ())
    records = collect_site_records(self)  # what the sites sowed (nnx.Intermediate)
    if recording.form != "none":
      aux["sites"] = {k: r.record for k, r in records.items() if r.record is not None}
      aux["fallbacks"] = {k: r.fallback for k, r in records.items() if r.fallback is not None}
    if recording.inputs:
      aux["site_inputs"] = {k: r.input for k, r in records.items() if r.input is not None}
    return logits, aux
