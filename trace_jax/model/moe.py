"""Mixture-of-Experts feed-forward: softmax router, top-k, SwiGLU experts, shared expert.

Two dispatch paths that compute the same function:
  grouped  tokens sorted by expert and multiplied tile by tile (`layers.ragged_matmul`,
           ragged_dot's function); the work grows with k, not with the number of experts
           (the production path);
  dense    every expert on every token, combined with a [N, E] weight matrix (a reference).
Routed-expert activations are quantized per (token, expert) row, so a row's FP4 values do
not depend on which other rows share its expert, and padding never feeds another row's scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from trace_jax import kernels
from trace_jax.kernels import layout as kernel_layout
from trace_jax.model.config import ModelConfig
from trace_jax.model.layers import block_tile_rows, matmul, swiglu
from trace_jax.model.parameters import normal_param
from trace_jax.model.quantizer import SiteQuantizer
from trace_jax.model.sites import MLP_IN, MLP_MID, MOE_IN, MOE_MID, SHARED_MID, Site, sow_site


@struct.dataclass
class RouterStats:
  """What one MoE layer reports of its routing."""

  experts: jax.Array  # int32 [B, T, k], descending router probability
  chosen: jax.Array  # int32 [B, T, k], the router's own top-k (the experts, unless replayed)
  lb_loss: jax.Array  # float32 [], the load-balancing loss
  load: jax.Array  # float32 [E], the share of (token, slot) choices per expert


class MLP(nnx.Module):
  """A SwiGLU feed-forward: a dense layer (`dense`), or the shared expert of an MoE layer
  (`shared_expert`)."""

  def __init__(
    self,
    d_model: int,
    ffn_dim: int,
    std: float,
    *,
    group: str,
    in_site: Site,
    mid_site: Site,
    rngs: nnx.Rngs,
  ):
    """group: the weights' FP4 group ("mlp" or "shared"); in_site, mid_site: the sites whose
    activations the gate/up and the down projections multiply."""
    # Column-split gate/up, row-split down over "model" (Megatron), FSDP on d_model; gate
    # and up share one FP4 global scale (one fused gate_up_proj).
    gate_up = dict(sharding=("data", "model"), quant_group=group, input_site=in_site)
    self.w_gate = normal_param(rngs, (d_model, ffn_dim), std, scale_group=("gate_up", 0), **gate_up)
    self.w_up = normal_param(rngs, (d_model, ffn_dim), std, scale_group=("gate_up", 1), **gate_up)
    self.w_down = normal_param(
      rngs,
      (ffn_dim, d_model),
      std,
      sharding=("model", "data"),
      quant_group=group,
      input_site=mid_site,
    )
    self.mid_site = mid_site

  @classmethod
  def dense(cls, cfg: ModelConfig, *, rngs: nnx.Rngs) -> "MLP":
    """The feed-forward of a dense layer (sites mlp_in, mlp_mid)."""
    return cls(
      cfg.d_model,
      cfg.ffn_dim,
      cfg.init_std,
      group="mlp",
      in_site=MLP_IN,
      mid_site=MLP_MID,
      rngs=rngs,
    )

  @classmethod
  def shared_expert(cls, cfg: ModelConfig, *, rngs: nnx.Rngs) -> "MLP":
    """The shared expert of an MoE layer: fed moe_in's values, its own site shared_mid."""
    return cls(
      cfg.d_model,
      cfg.shared_expert_dim,
      cfg.init_std,
      group="shared",
      in_site=MOE_IN,
      mid_site=SHARED_MID,
      rngs=rngs,
    )

  def __call__(self, xq, *, layer: int, sq: SiteQuantizer):
    """xq: the input [..., d], already quantized if the scope quantizes it."""
    group = self.w_gate.quant_group
    gate, up = sq.matmuls(xq, (self.w_gate.get_value(), self.w_up.get_value()), group)  # shared gs
    mid = sow_site(self, sq, swiglu(gate, up), layer=layer, site=self.mid_site)
    return sq.matmul(mid, self.w_down.get_value(), self.w_down.quant_group)


def route(probs: jax.Array, k: int, norm_topk: bool, routing: jax.Array | None):
  """Top-k experts (descending probability) and their weights; `routing` replays experts.

  Args:
    probs: float32 [N, E] router softmax.
    routing: int [N, k] experts to use instead of choosing (routing replay), or None.
  Returns:
    experts int32 [N, k], weights float32 [N, k].
  """
  if routing is None:
    weights, experts = jax.lax.top_k(probs, k)
  else:
    experts = routing.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
  if norm_topk:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return experts, weights


def load_balancing_loss(probs: jax.Array, experts: jax.Array, valid: jax.Array) -> jax.Array:
  """Switch/Mixtral auxiliary loss E * sum_e f_e * P_e over valid tokens.

  f_e: the share of (token, slot) choices that went to expert e, times k (as Hugging Face's
  `load_balancing_loss_func` counts it); P_e: the mean router probability of e.
  """
  num_experts = probs.shape[-1]
  w = valid.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(w), 1.0)
  chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=1)  # [N, E]
  f = jnp.sum(chosen * w[:, None], axis=0) / count
  p = jnp.sum(probs * w[:, None], axis=0) / count
  return num_experts * jnp.sum(f * p)


class MoE(nnx.Module):
  """One MoE feed-forward layer; quantization sites moe_in, moe_mid (and shared_mid)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, e, f = cfg.d_model, cfg.num_experts, cfg.moe_ffn_dim
    self.router = normal_param(rngs, (d, e), cfg.init_std, sharding=("data", None))
    # Routed experts [E, in, out]: experts over "expert", widths over "model", FSDP on
    # d_model; each expert's gate and up share one FP4 global scale (gate_up_proj).
    gate_up = dict(sharding=("expert", "data", "model"), quant_group="experts", input_site=MOE_IN)
    self.w_gate = normal_param(rngs, (e, d, f), cfg.init_std, scale_group=("gate_up", 0), **gate_up)
    self.w_up = normal_param(rngs, (e, d, f), cfg.init_std, scale_group=("gate_up", 1), **gate_up)
    self.w_down = normal_param(
      rngs,
      (e, f, d),
      cfg.init_std,
      sharding=("expert", "model", "data"),
      quant_group="experts",
      input_site=MOE_MID,
    )
    self.shared = MLP.shared_expert(cfg, rngs=rngs) if cfg.shared_expert_dim else None
    self.shared_gate = (
      normal_param(rngs, (d, 1), cfg.init_std, sharding=(None, None))
      if cfg.shared_expert_dim and cfg.shared_expert_gate
      else None
    )
    self.top_k = cfg.num_experts_per_tok
    self.norm_topk = cfg.norm_topk_prob
    self.dispatch = cfg.dispatch

  def __call__(self, x, *, valid, layer: int, sq: SiteQuantizer, routing=None):
    """x [B, T, d] (normed), valid bool [B, T]; routing int [B, T, k] to replay, or None.

    Returns (out [B, T, d], RouterStats).
    """
    b, t, d = x.shape
    n, k = b * t, self.top_k
    # The router stays in float32: a flipped expert is a large, discrete mismatch. An
    # engine may run it in the activations' dtype (`CallOptions.router_dtype`, a study's
    # engine difference): then only the logits' softmax is float32.
    if sq.router_dtype == "compute":
      router = self.router.get_value().astype(x.dtype)
      logits = jnp.einsum("nd,de->ne", x.reshape(n, d), router).astype(jnp.float32)
    else:
      logits = jnp.einsum(
        "nd,de->ne",
        x.reshape(n, d).astype(jnp.float32),
        self.router.get_value(),
        precision=jax.lax.Precision.HIGHEST,
      )
    probs = jax.nn.softmax(logits, axis=-1)
    experts, weights = route(
      probs, k, self.norm_topk, None if routing is None else routing.reshape(n, k)
    )
    on_kernels = self._on_kernels(sq, layer)
    # The kernels quantize moe_in themselves unless the shared expert reads its values.
    fuse_in = on_kernels and sq.fuses(MOE_IN.name, layer)
    fuse_in = fuse_in and not (self.shared is not None and sq.active(SHARED_MID.name))
    if fuse_in:
      xq = x.reshape(n, d)
    else:
      xq = sow_site(self, sq, x, layer=layer, site=MOE_IN).reshape(n, d)
    if on_kernels:
      y = self._kernel_experts(xq, experts, fuse_in=fuse_in, layer=layer, sq=sq, shape=(b, t))
    else:
      dispatch = self._grouped if self.dispatch == "grouped" else self._dense
      y = dispatch(xq, experts, layer=layer, sq=sq, tokens_shape=(b, t))
    out = jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1).astype(x.dtype)  # [N, d]
    if self.shared is not None:
      # The shared expert reads moe_in's FP4 values only when it runs in FP4 itself (scope
      # "all"); under "experts+kv" it sees the high-precision input.
      shared_in = xq if sq.active(SHARED_MID.name) else x.reshape(n, d)
      # [B, T, d] in, so the shared_mid site (and its guidance) is laid out per token slot.
      shared = self.shared(shared_in.reshape(b, t, d), layer=layer, sq=sq).reshape(n, d)
      if self.shared_gate is not None:
        gate = jax.nn.sigmoid(matmul(shared_in, self.shared_gate.get_value().astype(xq.dtype)))
        shared = gate * shared
      out = out + shared
    flat_valid = valid.reshape(n)
    load = jnp.sum(jax.nn.one_hot(experts, probs.shape[-1]).sum(1) * flat_valid[:, None], 0)
    # Under replay the router's own choice is computed too: how often it would flip.
    chosen = experts if routing is None else jax.lax.top_k(probs, k)[1]
    stats = RouterStats(
      experts=experts.reshape(b, t, k),
      chosen=chosen.reshape(b, t, k),
      lb_loss=load_balancing_loss(probs, experts, flat_valid),
      load=load / jnp.maximum(jnp.sum(load), 1.0),
    )
    return out.reshape(b, t, d), stats

  def _weights(self):
    return tuple(w.get_value() for w in (self.w_gate, self.w_up, self.w_down))

  def _on_kernels(self, sq: SiteQuantizer, layer: int) -> bool:
    """Whether the routed experts run on the Pallas FP4 kernels (`kernels.moe_experts`):
    packed weights, grouped dispatch, and moe_mid either high precision or quantized in the
    down projection's prologue."""
    mid_ok = not sq.active(MOE_MID.name) or sq.fuses(MOE_MID.name, layer)
    return sq.on_kernels(self._weights()[2]) and self.dispatch == "grouped" and mid_ok

  def _kernel_experts(self, xq, experts, *, fuse_in: bool, layer: int, sq: SiteQuantizer, shape):
    """The routed experts as two expert-major grouped FP4 GEMMs (gate|up with SwiGLU, then
    down), moe_in (`fuse_in`) and moe_mid quantized and recorded in their prologues.
    Returns y [N, k, d] in (token, slot) order."""
    w_gate, w_up, w_down = self._weights()
    gate_up = w_gate if isinstance(w_gate, kernel_layout.FusedWeight) else (w_gate, w_up)
    fmt = sq.quant.fmt if sq.quant is not None else None
    mid = sq.active(MOE_MID.name)
    y, h, rec_in, rec_mid = kernels.moe_experts(
      xq,
      experts,
      gate_up,
      w_down,
      quantize_in=fmt if fuse_in else None,
      quantize_mid=fmt if mid else None,
      record=sq.record_form(layer),
      out_dtype=xq.dtype,
    )
    reshape = lambda tree, lead: jax.tree.map(lambda a: a.reshape(*lead, a.shape[-1]), tree)  # noqa: E731
    k = experts.shape[1]
    for site, used, x, record, lead in (
      (MOE_IN, fuse_in, xq, rec_in, shape),
      (MOE_MID, mid, h, rec_mid, (*shape, k)),
    ):
      site_record = (
        sq.fused_record(reshape(x, lead), layer, reshape(record, lead)) if used else None
      )
      if site_record is not None:
        self.sow(nnx.Intermediate, site.name, site_record)
    return y

  def _grouped(self, xq, experts, *, layer: int, sq: SiteQuantizer, tokens_shape):
    """Sorted-by-expert dispatch (`layers.ragged_matmul`): xq [N, d], experts int32 [N, k], N the
    B * T tokens of `tokens_shape`. Returns y [N, k, d] in (token, slot) order.

    With `sq.moe_blocks` > 1 dividing B, the sequences are cut into that many equal blocks
    and each block sorts and multiplies its own rows: on a mesh whose "data" axis splits the
    batch into those blocks, each shard dispatches its own tokens (one sort over the whole
    batch would make every device sort, gather and multiply every shard's rows). A block's
    tiles are about one per expert (`layers.block_tile_rows`). Each row's product is the
    same."""
    w_gate, w_up, w_down = self._weights()
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    blocks = sq.moe_blocks if tokens_shape[0] % sq.moe_blocks == 0 else 1
    lead, tile = (), None
    if blocks > 1:
      lead = (blocks,)
      tile = block_tile_rows(n * k // blocks, num_experts)
    flat = experts.reshape(*lead, -1)  # [(blocks,) N * k / blocks], row r: token r // k, slot r % k
    order = jnp.argsort(flat, axis=-1, stable=True)
    inverse = jnp.argsort(order, axis=-1)
    count = lambda f: jnp.bincount(f, length=num_experts)  # noqa: E731
    group_sizes = (jax.vmap(count)(flat) if lead else count(flat)).astype(jnp.int32)

    def take(a, rows):  # a [(blocks,) R, f] at rows [(blocks,) R] of each block
      return jnp.take_along_axis(a, rows[..., None], axis=-2) if lead else a[rows]

    xs = take(xq.reshape(*lead, -1, xq.shape[-1]), order // k)  # grouped by expert

    # Gate and up of each expert share one global scale (served as one fused gate_up_proj).
    h = swiglu(*sq.ragged_dots(xs, (w_gate, w_up), group_sizes, tile=tile))  # sorted
    # Quantize in (token, slot) order so recorded and given guidance line up with tokens.
    h = take(h, inverse).reshape(*tokens_shape, k, -1)
    h = take(
      sow_site(self, sq, h, layer=layer, site=MOE_MID).reshape(*lead, -1, h.shape[-1]), order
    )
    y = sq.ragged_dot(h, w_down, group_sizes, tile=tile)
    return take(y, inverse).reshape(n, k, -1)

  def _dense(self, xq, experts, *, layer: int, sq: SiteQuantizer, tokens_shape):
    """Every expert on every token (reference; arguments as `_grouped`). Returns y [N, k, d]."""
    w_gate, w_up, w_down = self._weights()
    n, k = experts.shape
    if sq.guidance:
      raise ValueError("dispatch='dense' is a reference path without guidance; use 'grouped'")
    (w_gate, w_up), w_down = (
      sq.weight_group((w_gate, w_up), self.w_gate.quant_group),
      sq.weight(w_down, self.w_down.quant_group),
    )
    precision = jax.lax.Precision.HIGHEST if xq.dtype == jnp.float32 else None

    def einsum(spec, a, b):
      return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32).astype(
        a.dtype
      )

    h = swiglu(einsum("nd,edf->enf", xq, w_gate), einsum("nd,edf->enf", xq, w_up))  # [E, N, f]
    if sq.records(layer) and sq.active(MOE_MID.name):  # record the chosen rows, (token, slot) order
      chosen = h[experts, jnp.arange(n)[:, None]]  # [N, k, f]
      sow_site(self, sq, chosen.reshape(*tokens_shape, k, -1), layer=layer, site=MOE_MID)
    h = sq(h, layer, MOE_MID.name)
    y = einsum("enf,efd->end", h, w_down)  # [E, N, d]
    return y[experts, jnp.arange(n)[:, None]]  # [N, k, d]
