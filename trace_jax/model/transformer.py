"""The policy model: a decoder-only MoE transformer in Flax NNX.

Calling convention (a contract with the rollout and training paths):

  out = model(tokens, positions=..., mask=..., cache=..., quant=..., guidance=..., options=...)
  # and, on a rollout that emulates another engine, skew=... (`skew.py`)

`quant` is what runs in FP4 (`QuantConfig`), `options` how this call runs (`CallOptions`:
kernels, what it records, compute dtype); `guidance` the one guidance (`Guidance`:
the rollout's site records, its routing to replay, a stochastic-rounding key). `out` is a
`ModelOutput`: logits float32 [B, T, V]; routing int32 [num_moe_layers, B, T, k] with each
token's experts in descending router probability; lb_loss (mean over MoE layers);
router_load [num_moe_layers, E]; with a cache, the updated cache (K/V at attention layers,
conv and recurrent states at Gated DeltaNet layers); and what `options.recording` asked for:
sites ({(layer, site): record in the recording's form}), fallbacks ({(layer, site): bool
mask} of guidance fallbacks at guided sites) and site_inputs (the inputs before
quantization). Where the call ran layers under a scan these three are `sites.ByLayer`s
(one stack per site, read like the dict: the scan's records are not cut per layer).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from trace_jax.guidance import Guidance
from trace_jax.model.attention import Attention
from trace_jax.model.cache import KVCache, entry_at, put_entry
from trace_jax.model.config import ModelConfig
from trace_jax.model.deltanet import GatedDeltaNet
from trace_jax.model.layers import LayerInputs, RMSNorm, rope_tables
from trace_jax.model.moe import MLP, MoE
from trace_jax.model.parameters import normal_param
from trace_jax.model.quant import CallOptions, QuantConfig
from trace_jax.model.quantizer import SiteQuantizer
from trace_jax.model.scan import LayerGroup, in_key_order, layer_groups, stack_layers
from trace_jax.model.sites import (
  MLP_IN,
  ScannedSiteRecord,
  collect_scanned_site_records,
  collect_site_records,
  site_record_field,
  sow_site,
)
from trace_jax.model.skew import Skew


@struct.dataclass
class ModelOutput:
  """What one forward returns (a pytree: it crosses jit boundaries as it is)."""

  logits: jax.Array  # float32 [B, T, V]
  routing: jax.Array  # int32 [num_moe_layers, B, T, k], descending router probability
  lb_loss: jax.Array  # float32 [], the load-balancing loss, mean over MoE layers
  router_load: jax.Array  # float32 [num_moe_layers, E]
  # int32 [num_moe_layers, B, T, k], each MoE layer's own top-k: the routing, unless replayed
  router_choice: jax.Array | None = None
  cache: KVCache | None = None  # the updated cache, when the call had one
  # {(layer, site): ...} (a `ByLayer` where layers ran under a scan): the records in
  # recording.form, the guided sites' bool fallbacks, the inputs (recording.inputs)
  sites: Mapping = struct.field(default_factory=dict)
  fallbacks: Mapping = struct.field(default_factory=dict)
  site_inputs: Mapping = struct.field(default_factory=dict)


class Block(nnx.Module):
  """Pre-norm residual block: attention (softmax, or Gated DeltaNet at the linear layers of
  a hybrid model), then an MoE (or dense) feed-forward."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.zero_centered_norm)
    self.linear = layer in cfg.linear_layers
    self.attn = GatedDeltaNet(cfg, rngs=rngs) if self.linear else Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.zero_centered_norm)
    if layer in cfg.dense_layers:
      self.mlp, self.moe = MLP.dense(cfg, rngs=rngs), None
    else:
      self.mlp, self.moe = None, MoE(cfg, rngs=rngs)
    self.layer = layer

  def __call__(self, x, inputs: LayerInputs, *, sq: SiteQuantizer, cache=None, routing=None):
    """x [B, T, d]; cache: this layer's (k, v) entries or (conv, recurrent) state; routing
    int [B, T, k] to replay. Returns (x, updated cache entries or None, RouterStats or None)."""
    if self.linear:  # cache: (conv, recurrent) state; entries: the updated state
      attn_out, entries = self.attn(self.attn_norm(x), inputs, layer=self.layer, sq=sq, state=cache)
    else:
      attn_out, entries = self.attn(self.attn_norm(x), inputs, layer=self.layer, sq=sq, cache=cache)
    x = x + attn_out
    h = self.mlp_norm(x)
    if self.moe is not None:
      out, stats = self.moe(h, valid=inputs.valid, layer=self.layer, sq=sq, routing=routing)
    else:
      xq = sow_site(self, sq, h, layer=self.layer, site=MLP_IN)
      out, stats = self.mlp(xq, layer=self.layer, sq=sq), None
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
    raise ValueError(
      f"{what} hold token ids {np.unique(ids[bad])[:5].tolist()} outside the "
      f"vocabulary [0, {vocab_size}) (first at index {first})"
    )


def embed_tokens(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """Rows of the embedding table; an id outside [0, V) gives a NaN row, never another
  token's row (jnp.take would wrap negative ids around)."""
  vocab = table.shape[0]
  tokens = jnp.where(tokens < 0, vocab, tokens)
  return jnp.take(table, tokens, axis=0, mode="fill", fill_value=jnp.nan)


def _rematerialized(block: Block, sq: SiteQuantizer):
  """`block`'s call under `nnx.remat` (jax.checkpoint): the backward pass recomputes the
  block's activations from its input instead of keeping them (ModelConfig.remat). Only for
  calls without a cache (a rollout has no backward pass). Recorded sites work: what the
  block sows leaves the rematerialised function as its outputs (the enclosing
  `nnx.capture`'s state is an nnx state update of the block), so the records are the
  forward's own and the backward, which never reads them, recomputes only activations."""

  def call(x, inputs, *, routing):
    inner = lambda blk, x, inputs, routing: blk(x, inputs, sq=sq, routing=routing)
    return nnx.remat(inner)(block, x, inputs, routing)

  return call


def _layer_signature(block: Block, sq: SiteQuantizer):
  """What shapes a layer's program in this forward: two layers with equal signatures run
  the same computation on different parameters, guidance and layer ids."""
  layer = block.layer
  params = nnx.state(block)
  guide = tuple(
    (site, jax.tree.structure(g), tuple((a.shape, a.dtype) for a in jax.tree.leaves(g)))
    for (at, site), g in sorted(sq.guidance.items())
    if at == layer
  )
  return (
    block.linear,
    block.moe is None,
    layer in sq.guided,
    sq.records(layer),
    jax.tree.structure(params),
    tuple((a.shape, a.dtype) for a in jax.tree.leaves(params)),
    guide,
  )


def _cached_block(
  block: Block, x, inputs: LayerInputs, sq: SiteQuantizer, stacks, position, routing
):
  """`block` over the cache: `stacks` {"k", "v", "conv", "recurrent"} are the cache's
  `LayerEntries` stacks and `position` the block's place in the stacks of its kind (an int,
  or traced in a scan over layers). Attention writes its new slots into the K and V stacks;
  a Gated DeltaNet layer's whole state is replaced. Returns (x, stacks, RouterStats or None)."""
  if block.linear:
    state = (entry_at(stacks["conv"], position), entry_at(stacks["recurrent"], position))
    x, (conv, recurrent), stats = block(x, inputs, sq=sq, cache=state, routing=routing)
    stacks = dict(
      stacks,
      conv=put_entry(stacks["conv"], conv, position),
      recurrent=put_entry(stacks["recurrent"], recurrent, position),
    )
  else:
    cache = (stacks["k"], stacks["v"], position)
    x, (k, v), stats = block(x, inputs, sq=sq, cache=cache, routing=routing)
    stacks = dict(stacks, k=k, v=v)
  return x, stacks, stats


def _scanned_layer(graphdef, sq: SiteQuantizer, inputs: LayerInputs, remat: bool):
  """One layer of a scan step as a pure function of its stacked slices:
  (state, x, layer_id, routing, guidance, stacks, position) -> (x, RouterStats or None,
  {path: sown}, stacks).

  The block is rebuilt from `graphdef` (the pattern's template layer, whose static facts
  every layer of the run shares) and its slice of the parameters; `sq` is relabelled so
  that its guidance is this layer's and its stochastic keys fold the real layer id. With a
  cache, `stacks` are the cache's stacks (the scan's carry) and `position` the layer's
  place in them (`_cached_block`); without one both are None. Under `remat` the function
  is rematerialised (jax.checkpoint) per layer."""

  def call(state, x, layer_id, routing, guidance, stacks, position):
    block = nnx.merge(graphdef, state)
    layer_sq = sq.relabelled(block.layer, layer_id, guidance)

    def run(blk, x, stacks):
      if stacks is None:
        x, _, stats = blk(x, inputs, sq=layer_sq, routing=routing)
        return x, stacks, stats
      return _cached_block(blk, x, inputs, layer_sq, stacks, position, routing)

    if not layer_sq.records(block.layer):
      x, stacks, stats = run(block, x, stacks)
      return x, stats, {}, stacks
    (x, stacks, stats), sown = nnx.capture(run, nnx.Intermediate)(block, x, stacks)
    flat = nnx.to_flat_state(sown)
    values = {tuple(path): v.get_value() if hasattr(v, "get_value") else v for path, v in flat}
    return x, stats, values, stacks

  return jax.checkpoint(call) if remat else call


class Transformer(nnx.Module):
  """Embedding, `num_layers` blocks, final RMSNorm and LM head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    # Vocabulary over "model", FSDP on d_model; embedding and LM head stay high precision.
    self.embed = normal_param(
      rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, sharding=("model", "data")
    )
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.zero_centered_norm)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else normal_param(
        rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, sharding=("data", "model")
      )
    )

  def __call__(
    self,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    mask: jax.Array | None = None,
    cache: KVCache | None = None,
    quant: QuantConfig | None = None,
    guidance: Guidance | None = None,
    options: CallOptions | None = None,
    skew: Skew | None = None,
  ) -> ModelOutput:
    """Forward over tokens [B, T].

    Args:
      tokens: int [B, T].
      positions: int [B, T] RoPE positions; default the slot index (0.. T-1, or continuing
        the cache).
      mask: bool [B, T], False for padding; default all True.
      cache: a KVCache to write slots [cache.index, cache.index + T) into and attend over
        (an index per row [B]: each row at its own slots).
      quant: what runs in FP4 (training path: fake-quantized master weights; rollout path:
        params made by `quantize_params`; None or precision "bf16": off).
      guidance: the rollout's `Guidance`, the model's one guidance input: its sites drive
        quant.rounding == "guided" (needs rounding "guided" when it holds any), its
        routing, if any, int [num_moe_layers, B, T, k], is replayed instead of routing, and
        its key draws quant.rounding == "stochastic".
      options: how this call runs (default `CallOptions()`): `kernels`, `recording`
        (returned as `ModelOutput.sites`, `fallbacks`, `site_inputs`), `compute_dtype`
        (default cfg.dtype, e.g. bf16 for a rollout of a float32-configured policy),
        `last_logits` (`ModelOutput.logits` [B, 1, V] at the last slot only).
      skew: a `Skew` (a rollout engine that computes differently): every layer's output
        times 1 + skew.amount * u, u hashed from (version, sequence, position, layer,
        element); None: exactly the unskewed program.

    Returns:
      a `ModelOutput`.
    """
    check_token_ids(tokens, self.cfg.vocab_size)  # here: inside capture the ids are traced
    # The sites sow their records into nnx.Intermediate; capture collects them (flax's way
    # of extracting intermediates) without leaving them on the modules.
    # A call that records nothing sows nothing: it runs without capture, so the model also
    # works closed over by a plain `jax.jit` (capture writes module state, which nnx only
    # allows at the trace level the module was made at).
    options = CallOptions() if options is None else options
    recording = options.recording
    if not recording.enabled:
      return self._forward(tokens, positions, mask, cache, quant, guidance, options, skew)
    out, sown = nnx.capture(Transformer._forward, nnx.Intermediate)(
      self, tokens, positions, mask, cache, quant, guidance, options, skew
    )
    records, scanned = collect_site_records(sown), collect_scanned_site_records(sown)
    if recording.form != "none":
      out = out.replace(
        sites=site_record_field(records, scanned, "record"),
        fallbacks=site_record_field(records, scanned, "fallback"),
      )
    if recording.inputs:
      out = out.replace(site_inputs=site_record_field(records, scanned, "input"))
    return out

  def _layer_groups(self, sq: SiteQuantizer) -> list[LayerGroup]:
    """The forward's layers, cut into scanned runs of alike layers (`scan.layer_groups`)
    where `cfg.scan_layers` holds, else one group per layer."""
    if not self.cfg.scan_layers:
      return [LayerGroup(i, 1, 1) for i in range(self.cfg.num_layers)]
    return layer_groups([_layer_signature(block, sq) for block in self.blocks])

  def _scan_group(
    self, group: LayerGroup, x, inputs, sq, routing, moe_index, skew, positions, cache
  ):
    """Layers of `group` under one `jax.lax.scan` over its repeats: each step runs the
    pattern's layers once, from their parameters stacked by repeat (and their routing to
    replay, guidance and layer ids). What the layers sow stays stacked by layer: one
    `ScannedSiteRecord` per site and pattern layer, sown on the transformer. `cache`:
    (stacks, {layer: position in its stacks}) or None; the stacks are the scan's carry.
    Returns (x, [(layers, stats stacked by layer)], stacks)."""
    stacks, places = (None, None) if cache is None else cache
    templates = [self.blocks[group.start + j] for j in range(group.period)]
    calls, xs = [], []
    for j, template in enumerate(templates):
      layers = group.layers(j)
      state = stack_layers([nnx.state(self.blocks[layer]) for layer in layers])
      layer_routing = None
      if routing is not None and template.moe is not None:
        layer_routing = routing[np.array([moe_index[layer] for layer in layers])]
      guide = {
        site: stack_layers([sq.guidance[(layer, site)] for layer in layers])
        for (at, site) in sq.guidance
        if at == template.layer
      }
      place = None if places is None else jnp.asarray([places[i] for i in layers], jnp.int32)
      remat = self.cfg.remat and stacks is None  # (a rollout has no backward pass)
      calls.append(_scanned_layer(nnx.graphdef(template), sq, inputs, remat))
      xs.append((state, jnp.asarray(layers, jnp.int32), layer_routing, guide, place))

    def step(carry, xs):
      x, stacks = carry
      outs = []
      for call, (state, layer_id, layer_routing, guide, place) in zip(calls, xs):
        x, stats, sown, stacks = call(state, x, layer_id, layer_routing, guide, stacks, place)
        if skew is not None:
          x = skew.apply(x, positions, layer_id)
        outs.append((stats, sown))
      return (x, stacks), outs

    (x, stacks), outs = jax.lax.scan(step, (x, stacks), xs)
    stats_parts = []
    for j, (stats, sown) in enumerate(outs):
      layers = group.layers(j)
      if stats is not None:
        stats_parts.append((layers, stats))
      for path, items in sown.items():
        for item in items:  # a site's records stay stacked by layer (`ByLayer` joins them)
          self.sow(nnx.Intermediate, "scanned_sites", ScannedSiteRecord(item, layers, path[-1]))
    return x, stats_parts, stacks

  def _forward(
    self, tokens, positions, mask, cache, quant, guidance, options, skew=None
  ) -> ModelOutput:
    cfg = self.cfg
    dtype = cfg.compute_dtype if options.compute_dtype is None else jnp.dtype(options.compute_dtype)
    b, t = tokens.shape
    if mask is None:
      mask = jnp.ones((b, t), bool)
    start = jnp.zeros((), jnp.int32) if cache is None else cache.index
    # A cache index per row ([B]: the rollout's slot pool) writes each row at its own slots.
    slots = (start[:, None] if start.ndim else start) + jnp.arange(t, dtype=jnp.int32)
    if positions is None:
      positions = jnp.broadcast_to(slots, (b, t))
    if guidance is not None and not isinstance(guidance, Guidance):
      raise ValueError(
        f"guidance must be a trace_jax.guidance.Guidance, got {type(guidance).__name__}"
      )
    routing = None if guidance is None else guidance.routing
    if routing is not None and routing.shape[:3] != (cfg.num_moe_layers, b, t):
      raise ValueError(
        f"routing has shape {routing.shape}; expected "
        f"({cfg.num_moe_layers}, {b}, {t}, {cfg.num_experts_per_tok})"
      )
    sq = SiteQuantizer(
      quant,
      cfg.num_layers,
      dtype,
      options=options,
      guidance=None if guidance is None else guidance.sites,
      key=None if guidance is None else guidance.key,
    )
    cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
    if cache is None:
      attn_mask = attention_mask(mask, jnp.broadcast_to(slots, (b, t)), slots, cfg.sliding_window)
      valid_cache = None
    else:
      if start.ndim:
        valid_cache = cache.valid.at[jnp.arange(b)[:, None], slots].set(mask)
      else:
        valid_cache = jax.lax.dynamic_update_slice_in_dim(cache.valid, mask, start, axis=1)
      key_slots = jnp.arange(cache.max_len, dtype=jnp.int32)
      attn_mask = attention_mask(
        valid_cache, jnp.broadcast_to(slots, (b, t)), key_slots, cfg.sliding_window
      )
    inputs = LayerInputs(cos=cos, sin=sin, attn_mask=attn_mask, valid=mask, start=start)

    x = embed_tokens(self.embed.get_value(), tokens).astype(dtype)
    stacks = places = None
    if cache is not None:  # the cache's stacks, threaded through the layers
      fields = ("k", "v", "conv", "recurrent")
      entries = {name: getattr(cache, name) for name in fields}
      stacks = {name: getattr(e, "stack", None) for name, e in entries.items()}
      places = {
        layer: i for e in (entries["k"], entries["conv"]) if e for i, layer in enumerate(e.layers)
      }
    moe_stats = []  # (layers, RouterStats stacked by layer)
    moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    for group in self._layer_groups(sq):
      if group.scanned:
        x, stats, stacks = self._scan_group(
          group, x, inputs, sq, routing, moe_index, skew, positions,
          None if cache is None else (stacks, places),
        )  # fmt: skip
        moe_stats += stats
        continue
      block = self.blocks[group.start]
      i = block.layer
      layer_routing = None
      if routing is not None and block.moe is not None:
        layer_routing = routing[moe_index[i]]
      if cache is None and cfg.remat:
        x, _, stats = _rematerialized(block, sq)(x, inputs, routing=layer_routing)
      elif cache is None:
        x, _, stats = block(x, inputs, sq=sq, routing=layer_routing)
      else:
        x, stacks, stats = _cached_block(block, x, inputs, sq, stacks, places[i], layer_routing)
      if skew is not None:  # static: without a skew the program has no multiply
        x = skew.apply(x, positions, i)
      if stats is not None:
        moe_stats.append(((i,), jax.tree.map(lambda a: a[None], stats)))
    # Final norm and LM head in float32: the log-probabilities RL needs are read here.
    if options.last_logits:  # (the prefill samples from its last slot only)
      x = x[:, -1:]
    h = self.final_norm(x).astype(jnp.float32)
    head = self.embed.get_value().T if self.lm_head is None else self.lm_head.get_value()
    logits = jnp.einsum("btd,dv->btv", h, head, precision=jax.lax.Precision.HIGHEST)

    if moe_stats:
      _, stats = in_key_order(moe_stats)  # MoE layers in order
      routing_out, lb_loss, router_load = stats.experts, jnp.mean(stats.lb_loss), stats.load
      choice = stats.chosen
    else:
      routing_out = choice = jnp.zeros((0, b, t, cfg.num_experts_per_tok), jnp.int32)
      lb_loss = jnp.zeros((), jnp.float32)
      router_load = jnp.zeros((0, cfg.num_experts), jnp.float32)
    new_cache = None
    if cache is not None:
      held = lambda name: (  # noqa: E731
        entries[name].with_stack(stacks[name]) if entries[name] else entries[name]
      )
      new_cache = KVCache(
        k=held("k"),
        v=held("v"),
        valid=valid_cache,
        index=start + t,
        conv=held("conv"),
        recurrent=held("recurrent"),
      )
    return ModelOutput(
      logits=logits,
      routing=routing_out,
      lb_loss=lb_loss,
      router_load=router_load,
      router_choice=choice,
      cache=new_cache,
    )
