"""Grouped-query attention with RoPE, optional QK-norm, masks and a KV cache.

Qwen3.5's gated attention (`cfg.attn_output_gate`): q_proj emits [query | gate] per head,
and the attention output is multiplied by sigmoid(gate) before the output projection;
its RoPE may rotate only part of each head (`cfg.partial_rotary_factor`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import fp4, kernels
from trace_jax.model import cache as kv_cache
from trace_jax.model.config import ModelConfig
from trace_jax.model.layers import LayerInputs, RMSNorm, apply_rope
from trace_jax.model.parameters import normal_param
from trace_jax.model.quantizer import SiteQuantizer
from trace_jax.model.sites import ATTN_IN, ATTN_OUT, K, V, Site, sow_cache_entry, sow_site

_MASKED = -1e30  # finite, so a fully masked (padding) query row gives a uniform softmax, not NaN


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax attention in float32.

  Args:
    q: [B, T, H, Dh].
    k, v: [B, S, Hkv, Dh]; H is a multiple of Hkv (grouped-query attention).
    mask: bool [B, T, S], True where query t may attend to key s.

  Returns:
    [B, T, H, Dh] in q's dtype.
  """
  b, t, h, dh = q.shape
  hkv = k.shape[2]
  q = q.reshape(b, t, hkv, h // hkv, dh)
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  scores = jnp.einsum(
    "btkgd,bskd->bkgts", q, k, precision=precision, preferred_element_type=jnp.float32
  ) * (dh**-0.5)
  scores = jnp.where(mask[:, None, None], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1)
  # A masked slot gets probability 0, but 0 * NaN is NaN: a stale cache slot (or a later
  # token) holding NaN or Inf would poison every query.
  if t == 1:
    # A decode step: one query per sequence, so the slots it may see are the sequence's.
    # Zero the others in the product's operand (a select XLA fuses into the dot: V is read
    # once); a non-finite value in a seen slot then makes the output non-finite by itself.
    # A fully masked (padding) row keeps its uniform softmax over every slot.
    seen = mask[:, 0] | ~jnp.any(mask[:, 0], axis=-1, keepdims=True)  # [B, S]
    v = jnp.where(seen[:, :, None, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum(
      "bkgts,bskd->btkgd",
      probs.astype(v.dtype),
      v,
      precision=precision,
      preferred_element_type=jnp.float32,
    )
    out = jnp.where(jnp.isfinite(out), out, jnp.nan)
    return out.reshape(b, t, h, dh).astype(q.dtype)
  # Several queries see different slots: zero non-finite values before the product, then
  # mark NaN exactly the queries that give such a slot positive weight.
  finite = jnp.all(jnp.isfinite(v), axis=-1)  # [B, S, Hkv]
  v = jnp.where(finite[..., None], v, jnp.zeros((), v.dtype))
  out = jnp.einsum(
    "bkgts,bskd->btkgd",
    probs.astype(v.dtype),
    v,
    precision=precision,
    preferred_element_type=jnp.float32,
  )
  seen = jnp.where(mask[:, None, None], probs, 0.0)
  poisoned = jnp.einsum("bkgts,bsk->btkg", seen, (~finite).astype(jnp.float32)) > 0
  out = jnp.where(poisoned[..., None], jnp.nan, out)
  return out.reshape(b, t, h, dh).astype(q.dtype)


class Attention(nnx.Module):
  """Self-attention of one layer; quantization sites attn_in, k, v, attn_out."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h, hkv, dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.output_gate = cfg.attn_output_gate
    # Megatron: q/k/v column-split and o row-split over "model" by whole heads, FSDP over
    # "data" on the d_model side. q, k and v share one FP4 global scale (one fused qkv_proj).
    qkv = dict(sharding=("data", "model"), quant_group="attention", input_site=ATTN_IN)
    width = h * dh * (2 if self.output_gate else 1)  # [query | gate] per head with the gate
    self.q_proj = normal_param(
      rngs, (d, width), cfg.init_std, heads=h, scale_group=("qkv", 0), **qkv
    )
    self.k_proj = normal_param(
      rngs, (d, hkv * dh), cfg.init_std, heads=hkv, scale_group=("qkv", 1), **qkv
    )
    self.v_proj = normal_param(
      rngs, (d, hkv * dh), cfg.init_std, heads=hkv, scale_group=("qkv", 2), **qkv
    )
    self.o_proj = normal_param(
      rngs,
      (h * dh, d),
      cfg.init_std,
      sharding=("model", "data"),
      heads=h,
      quant_group="attention",
      input_site=ATTN_OUT,
    )
    if cfg.qk_norm == "head":
      zc = cfg.zero_centered_norm
      self.q_norm, self.k_norm = RMSNorm(dh, cfg.rms_eps, zc), RMSNorm(dh, cfg.rms_eps, zc)
    elif cfg.qk_norm == "full":
      self.q_norm, self.k_norm = RMSNorm(h * dh, cfg.rms_eps), RMSNorm(hkv * dh, cfg.rms_eps)
    else:
      self.q_norm = self.k_norm = None
    self.qk_norm = cfg.qk_norm
    self.clip_qkv = cfg.clip_qkv
    self.shape = (h, hkv, dh)

  def __call__(self, x, inputs: LayerInputs, *, layer: int, sq: SiteQuantizer, cache=None):
    """x [B, T, d] (normed); `inputs.attn_mask` [B, T, S] over the keys (T keys without a
    cache, the cache's L slots with one). `cache`: (k stack, v stack, position): the
    cache's `LayerEntries` stacks and this layer's position in them (an int, or traced in
    a scan over layers). Returns (out [B, T, d], the updated (k, v) stacks or None)."""
    b, t, _ = x.shape
    h, hkv, dh = self.shape
    cos, sin, mask, index = inputs.cos, inputs.sin, inputs.attn_mask, inputs.start
    # One global scale for q, k and v (served as one fused qkv_proj).
    projections = (self.q_proj, self.k_proj, self.v_proj)
    q, k, v = _site_matmuls(
      self,
      sq,
      x,
      [w.get_value() for w in projections],
      projections[0].quant_group,
      layer,
      ATTN_IN,
    )
    gate = None
    if self.output_gate:  # per head [query | gate]
      q, gate = jnp.split(q.reshape(b, t, h, 2 * dh), 2, axis=-1)
      q, gate = q.reshape(b, t, h * dh), gate.reshape(b, t, h * dh)
    if self.qk_norm == "full":
      q, k = self.q_norm(q), self.k_norm(k)
    if self.clip_qkv is not None:
      q, k, v = (jnp.clip(a, -self.clip_qkv, self.clip_qkv) for a in (q, k, v))
    q, k, v = q.reshape(b, t, h, dh), k.reshape(b, t, hkv, dh), v.reshape(b, t, hkv, dh)
    if self.qk_norm == "head":
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    stacks = None
    if cache is None:
      k, v = sow_site(self, sq, k, layer=layer, site=K), sow_site(self, sq, v, layer=layer, site=V)
    else:  # store the packed FP4 entries; attend to exactly their values
      k_stack, v_stack, position = cache
      keep = jnp.any(inputs.valid)  # a chunk of padding only writes blank slots
      fused = sq.fuses(K.name, layer) and sq.fuses(V.name, layer) and not jnp.ndim(index)
      if fused and isinstance(k_stack, fp4.QArray):  # (an index per row: XLA's scatter)
        # Quantized and written in place by one kernel, with both records.
        *stacks, k_record, v_record = kernels.write_kv(
          k, v, k_stack, v_stack, index, keep, layer=position, record=sq.record_form(layer)
        )
        for site, record, x_site in ((K, k_record, k), (V, v_record, v)):
          _sow(self, site, sq.fused_record(x_site, layer, record))
      else:
        stored = (
          sow_cache_entry(self, sq, k, layer=layer, site=K),
          sow_cache_entry(self, sq, v, layer=layer, site=V),
        )
        stacks = [
          kv_cache.write_slots(stack, new, index, position, keep)
          for stack, new in zip((k_stack, v_stack), stored)
        ]
      stacks = tuple(stacks)
      k, v = (kv_cache.entry_at(stack, position) for stack in stacks)
    if t == 1 and sq.kernels == "pallas" and isinstance(k, fp4.QArray):
      # A decode step: attend over the packed cache without dequantizing it.
      out = kernels.fp4_decode_attention(
        q[:, 0], *stacks, jnp.broadcast_to(index + 1, (b,)), mask[:, 0], layer=position
      )
    else:  # (read: dequantize a packed cache entry; a no-op cast otherwise)
      out = attend(q, kv_cache.read(k, q.dtype), kv_cache.read(v, q.dtype), mask)
    out = out.reshape(b, t, h * dh)
    if gate is not None:
      out = out * jax.nn.sigmoid(gate)
    (out,) = _site_matmuls(
      self, sq, out, [self.o_proj.get_value()], self.o_proj.quant_group, layer, ATTN_OUT
    )
    return out, stacks


def _sow(module: nnx.Module, site: Site, record) -> None:
  if record is not None:
    module.sow(nnx.Intermediate, site.name, record)


def _site_matmuls(module: nnx.Module, sq: SiteQuantizer, x, ws, group: str, layer: int, site: Site):
  """Activation site `site` and its consumer GEMMs `ws` (sharing x): with Pallas kernels,
  one FP4 GEMM that quantizes x in its prologue and records the site; else the site, then
  the GEMMs (of weight `group`)."""
  if sq.fuses(site.name, layer) and sq.on_kernels(ws[0]):
    outs, record = sq.quantized_matmuls(x, ws, layer, site.name)
    _sow(module, site, record)
    return outs
  return sq.matmuls(sow_site(module, sq, x, layer=layer, site=site), ws, group)
