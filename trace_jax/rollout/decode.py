"""The rollout's jitted programs: prefill of a prompt chunk, then the decode loop over the
KV cache, with guidance capture (`generate_program`), and a continuation that feeds an
observation chunk into the same cache and decodes again (`continue_program`). `Statics`
are their hashable static arguments; `RolloutEngine` (rollout.engine) prepares the inputs.

The decode loop asks "has every sequence stopped?" only every `stop_check_every` steps
(SamplingConfig; 8 on a GPU): that question is a while loop's data-dependent predicate,
which XLA:GPU copies to the host and waits for, so asking every token puts a host sync in
every step. Between checks the steps run as a fixed-count loop (no sync); a step after the
last sequence stopped writes exactly what an unwritten slot holds and does not advance the
cache, so the rollout is bit-identical to checking every step. XLA:GPU can also record the
loop's kernels into CUDA graphs ("command buffers"): `XLA_FLAGS=
--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL` (set before JAX starts) adds the loops
themselves to the default set (fusions, cuBLAS, custom calls), so even the remaining checks
need no launch per kernel; it is not set by the package because it changes nothing numerical
and costs graph instantiation on the first calls.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as guidance_lib
from trace_jax.model.cache import init_cache
from trace_jax.model import sharding as sharding_lib
from trace_jax.model.quant import CallOptions, Recording, resolve_layers
from trace_jax.model.sites import ByLayer
from trace_jax.rollout.config import RolloutConfig
from trace_jax.rollout.sampling import sample, sequence_keys
from trace_jax.rollout.trajectories import FINISH_LENGTH, FINISH_RUNNING, FINISH_STOP, Rollout


def _write(buffer, new, slot, axis=1):
  """Write `new` (pytree of [.., T, ..] arrays) into `buffer` at slots [slot, slot + T)
  (`slot` int32 [B], one per row, with the batch axis just before `axis`: the slot pool)."""
  if jnp.ndim(slot):
    rows = jnp.arange(slot.shape[0])[:, None]

    def put(b, n):
      cols = slot[:, None] + jnp.arange(n.shape[axis])
      at = (slice(None),) * (axis - 1) + (rows, cols)
      return b.at[at].set(n.astype(b.dtype))

    return jax.tree.map(put, buffer, new)
  return jax.tree.map(
    lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), slot, axis=axis),
    buffer,
    new,
  )


def _empty_like(tree, slots: int, axis: int = 1):
  """Zero buffers shaped like `tree` but with `slots` along `axis`."""

  def empty(leaf):
    shape = list(leaf.shape)
    shape[axis] = slots
    return jnp.zeros(shape, leaf.dtype)

  return jax.tree.map(empty, tree)


def _empty_records(sites, slots: int):
  """Guidance buffers for {(layer, site): record}: zeros, but global scales one, so the
  guidance of an empty slot decodes to 0, never to NaN."""

  def empty(record):
    record = _empty_like(record, slots)
    if isinstance(record, fp4.SparseGuidance):  # counts 0: an empty slot flags nothing
      return record
    return dataclasses.replace(record, global_scale=jnp.ones_like(record.global_scale))

  return {key: empty(record) for key, record in sites.items()}


def _forward(graphdef, params, tokens, positions, mask, cache, st: "Statics", skew=None):
  """The model on a chunk [B, C] at the cache's next slots; its logits [B, 1, V] at the
  chunk's last slot only (all the engine samples from: a prompt's LM head on every slot
  would be [B, C, V] float32, the largest buffer of a long prefill)."""
  model = nnx.merge(graphdef, params)
  return model(
    tokens,
    positions=positions,
    mask=mask,
    cache=cache,
    quant=st.config.quant,
    options=st.options.replace(last_logits=True),
    skew=skew,
  )


@dataclasses.dataclass(frozen=True)
class Statics:
  """Hashable static arguments of the jitted functions."""

  config: RolloutConfig
  guided_layers: tuple[int, ...]
  routing_dtype: Any
  capture_inputs: bool
  kernels: str  # "pallas" or "xla": `config.kernels` resolved (outside jit) by the engine
  mesh: Any = None  # place the cache and buffers made inside jit (batch over "data")
  stop_every: int = 1  # decode steps between stop checks (SamplingConfig.stop_check_every)

  @classmethod
  def of(
    cls, config: RolloutConfig, cfg, kernels: str, *, capture_inputs: bool = False, mesh=None
  ) -> "Statics":
    """The statics of a rollout of `config` for a `cfg` model on `kernels` ("pallas" or
    "xla", already resolved): its guided layers, routing dtype and stop-check interval."""
    guided = resolve_layers(config.guided_layers, cfg.num_layers, field="guided_layers")
    return cls(
      config=config,
      guided_layers=guided if config.guidance != "none" else (),
      routing_dtype=guidance_lib.routing_dtype(cfg.num_experts),
      capture_inputs=capture_inputs,
      kernels=kernels,
      mesh=mesh,
      stop_every=stop_check_every(config.sampling, pool=bool(config.slots)),
    )

  @property
  def recording(self) -> Recording:
    """The guided layers' sites, recorded in the guidance's own form (and inputs)."""
    return Recording(
      form=self.config.guidance,
      layers=self.guided_layers,
      inputs=self.capture_inputs,
      sparse=self.config.sparse,
    )

  @property
  def options(self) -> CallOptions:
    """How the model calls run: the kernels, what they record, the compute dtype (the
    rollout's quantization is `config.quant`); on a mesh each "data" shard dispatches its
    own sequences' tokens to the routed experts (`CallOptions.moe_blocks`)."""
    return CallOptions(
      kernels=self.kernels,
      recording=self.recording,
      compute_dtype=self.config.compute_dtype,
      moe_blocks=sharding_lib.data_shards(self.mesh),
      router_dtype=self.config.router_dtype,
    )


def _captured(out, st: Statics):
  """(guidance site entries, routing, inputs) of one forward's `ModelOutput`: the guided
  layers' records, already in the guidance's stored form, {(layer, site): [B, C, ...]}
  (the records of layers that ran under a scan cut out of their stacks: a chunk's are
  small, and the rollout's guidance keeps one buffer per layer and site)."""
  routing = out.routing.astype(st.routing_dtype) if st.config.record_routing else None
  inputs = _per_layer(out.site_inputs) if st.capture_inputs else None
  return _per_layer(out.sites), routing, inputs


def _per_layer(records):
  return records.unstack() if isinstance(records, ByLayer) else records


_MASKS = {"prompt": "prompt_mask", "env": "env_mask", "response": "response_mask"}


def _feed(
  graphdef, params, r: Rollout, chunk, chunk_mask, kind: str, st: Statics, skip=None, skew=None
):
  """Run a left-padded chunk [B, C] of prompt, observation or sampled tokens at the next
  slots: write tokens, positions, mask, cache and what is captured. `skew`: the engine's
  `Skew` (RolloutConfig.skew), or None.

  `skip` (bool scalar, decode steps): a step after every sequence stopped. It writes what
  an unwritten slot holds (the model writes blank cache entries for an all-padding chunk)
  and leaves the cache's write index where it was, so it leaves no trace.

  Returns the updated rollout and the logits [B, V] after the chunk's last slot.
  """
  slot = r.cache.index
  start_pos = jnp.sum(r.mask, axis=-1, dtype=jnp.int32)[:, None]
  positions = start_pos + jnp.maximum(jnp.cumsum(chunk_mask, axis=-1) - 1, 0)
  out = _forward(graphdef, params, chunk, positions, chunk_mask, r.cache, st, skew)
  sites, routing, inputs = _captured(out, st)
  cache = out.cache
  if skip is not None:
    blank = lambda tree, empty: jax.tree.map(  # noqa: E731
      lambda a, e: jnp.where(skip, e, a), tree, empty
    )
    positions = jnp.where(skip, 0, positions)
    sites = blank(sites, _empty_records(sites, chunk.shape[1]))
    routing = None if routing is None else jnp.where(skip, 0, routing)
    inputs = None if inputs is None else jax.tree.map(lambda a: jnp.where(skip, 0, a), inputs)
    cache = dataclasses.replace(cache, index=jnp.where(skip, slot, cache.index))
  updates = dict(
    tokens=_write(r.tokens, jnp.where(chunk_mask, chunk, st.config.pad_id), slot),
    positions=_write(r.positions, positions, slot),
    cache=cache,
  )
  updates[_MASKS[kind]] = _write(getattr(r, _MASKS[kind]), chunk_mask, slot)
  if r.guidance is not None and sites:
    written = _write(r.guidance.sites, sites, slot)  # kept on the rule's layout (the planner's)
    updates["guidance"] = dataclasses.replace(
      r.guidance, sites=sharding_lib.constrain_guidance_sites(written, st.mesh)
    )
  if routing is not None:
    updates["routing"] = _write(r.routing, routing, slot, axis=2)
  if inputs is not None:
    updates["site_inputs"] = _write(r.site_inputs, inputs, slot)
  return dataclasses.replace(r, **updates), out.logits[:, -1]


def _feed_prompt(graphdef, params, r: Rollout, prompt, prompt_mask, st: Statics, skew=None):
  """`_feed` of the prompt [B, P], `st.config.prefill_chunk` slots at a time: a first chunk
  of P mod chunk slots (if any), then a scan over the whole chunks, each attending over the
  cache the chunks before it wrote. Every slot sees the same cache entries, positions and
  mask as in one forward over the whole prompt; a chunk's forward holds a chunk's attention
  scores and expert tiles, not the prompt's. A prompt of at most one chunk is one `_feed`.
  Returns the rollout and the logits [B, V] after the prompt's last slot."""
  chunk, width = st.config.prefill_chunk, prompt.shape[1]
  feed = lambda r, tokens, mask: _feed(  # noqa: E731
    graphdef, params, r, tokens, mask, "prompt", st, skew=skew
  )
  if not chunk or width <= chunk:
    return feed(r, prompt, prompt_mask)
  first, whole = width % chunk, width // chunk
  if first:
    r, _ = feed(r, prompt[:, :first], prompt_mask[:, :first])

  def split(a):  # [B, P] -> [chunks, B, chunk] of the whole chunks
    return a[:, first:].reshape(a.shape[0], whole, chunk).swapaxes(0, 1)

  def step(carry, xs):
    r, _ = carry
    return feed(r, *xs), None

  vocab = nnx.merge(graphdef, params).cfg.vocab_size
  logits = jnp.zeros((prompt.shape[0], vocab), jnp.float32)
  (r, logits), _ = jax.lax.scan(step, (r, logits), (split(prompt), split(prompt_mask)))
  return r, logits


def _decode(
  graphdef, params, r: Rollout, logits, done, key, st: Statics, skew, sequence, budget
) -> Rollout:
  """Sample up to `budget` [B] new tokens per sequence (at most max_new_tokens); stop when
  all are done, asking every `st.stop_every` steps (a while loop over fixed-count chunks of
  steps; see the module docstring: the steps after the last stop of a chunk are exact
  no-ops). Each row draws with `sequence_keys(key, sequence [B], position)`."""
  sampling = st.config.sampling
  stop_tokens = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)
  every = st.stop_every

  def body(carry):
    step, r, logits, done, finish, key = carry
    skip = jnp.all(done) if every > 1 else None
    position = jnp.sum(r.mask, axis=-1, dtype=jnp.int32)  # the drawn token's RoPE position
    token, logp, sampling_logp = sample(logits, sequence_keys(key, sequence, position), sampling)
    active = ~done
    stopped = active & jnp.isin(token, stop_tokens)
    exhausted = active & ~stopped & (step + 1 >= budget)  # its own budget, all generated
    slot = r.cache.index
    r = dataclasses.replace(
      r,
      logprobs=_write(r.logprobs, jnp.where(active, logp, 0.0)[:, None], slot),
      sampling_logprobs=_write(
        r.sampling_logprobs, jnp.where(active, sampling_logp, 0.0)[:, None], slot
      ),
    )
    # Feed the token (also the last one: the cache and guidance must hold every token).
    r, logits = _feed(
      graphdef, params, r, token[:, None], active[:, None], "response", st, skip, skew
    )
    finish = jnp.where(stopped, FINISH_STOP, jnp.where(exhausted, FINISH_LENGTH, finish))
    return step + 1, r, logits, done | stopped | exhausted, finish, key

  def steps(n):  # n steps, a fixed-count loop: no host sync between them
    return lambda carry: jax.lax.fori_loop(0, n, lambda _, c: body(c), carry)

  chunked = sampling.max_new_tokens - sampling.max_new_tokens % every

  def cond(carry):
    step, _, _, done, _, _ = carry
    return (step < chunked) & ~jnp.all(done)

  finish = jnp.where(done, r.finish, FINISH_RUNNING)
  carry = (jnp.zeros((), jnp.int32), r, logits, done, finish, key)
  carry = jax.lax.while_loop(cond, body if every == 1 else steps(every), carry)
  if chunked < sampling.max_new_tokens:  # the rest of max_new_tokens, fewer than `every`
    carry = steps(sampling.max_new_tokens - chunked)(carry)
  _, r, _, done, finish, _ = carry
  return dataclasses.replace(r, finish=jnp.where(done, finish, FINISH_LENGTH))


def _empty_rollout(graphdef, params, batch: int, st: Statics) -> Rollout:
  """Empty buffers for a batch, shaped from one abstract forward."""
  cfg = nnx.merge(graphdef, params).cfg
  config = st.config
  slots = config.max_len
  cache = init_cache(cfg, batch, slots, config.quant, dtype=jnp.dtype(config.compute_dtype))
  cache = sharding_lib.constrain_cache(cache, st.mesh)
  one = jnp.zeros((batch, 1), jnp.int32)
  sites, routing, inputs = jax.eval_shape(
    lambda p, c: _captured(_forward(graphdef, p, one, one, one > -1, c, st), st), params, cache
  )
  guidance = None
  if config.guidance != "none" or routing is not None:
    guidance = guidance_lib.Guidance(
      sites=_empty_records(sites, slots),
      routing=None,
      mode=config.guidance,
      layers=st.guided_layers if config.guidance != "none" else (),
    )
  zeros = lambda dtype: sharding_lib.constrain_batch(jnp.zeros((batch, slots), dtype), st.mesh)
  if guidance is not None:
    guidance = dataclasses.replace(
      guidance, sites=sharding_lib.constrain_guidance_sites(guidance.sites, st.mesh)
    )
  if routing is not None:
    routing = sharding_lib.constrain_batch(_empty_like(routing, slots, axis=2), st.mesh, axis=1)
  return Rollout(
    tokens=jnp.full((batch, slots), config.pad_id, jnp.int32),
    positions=zeros(jnp.int32),
    prompt_mask=zeros(bool),
    response_mask=zeros(bool),
    env_mask=zeros(bool),
    logprobs=zeros(jnp.float32),
    sampling_logprobs=zeros(jnp.float32),
    finish=jnp.zeros((batch,), jnp.int32),
    guidance=guidance,
    routing=routing,
    cache=cache,
    site_inputs=None if inputs is None else _empty_like(inputs, slots),
  )


@functools.partial(jax.jit, static_argnums=(0, 8))
def generate_program(
  graphdef, params, prompt, prompt_mask, key, skew, sequence, budget, st: Statics
) -> Rollout:
  """Prefill and decode a batch: `sequence` uint32 [B] ids (sampling keys), `budget` int32
  [B] new tokens per sequence."""
  r = _empty_rollout(graphdef, params, prompt.shape[0], st)
  r, logits = _feed_prompt(graphdef, params, r, prompt, prompt_mask, st, skew=skew)
  done = jnp.zeros((prompt.shape[0],), bool)
  return _finalise(_decode(graphdef, params, r, logits, done, key, st, skew, sequence, budget))


# The cache is donated: a continuation writes into it in place instead of copying it (at
# long context the cache is most of a rollout's memory). `r` comes without it.
@functools.partial(jax.jit, static_argnums=(0, 10), donate_argnums=3)
def continue_program(
  graphdef, params, r: Rollout, cache, chunk, chunk_mask, key, skew, sequence, budget, st: Statics
) -> Rollout:
  r = dataclasses.replace(r, cache=cache)
  r, logits = _feed(graphdef, params, r, chunk, chunk_mask, "env", st, skew=skew)
  done = ~jnp.any(chunk_mask, axis=-1)  # no observation: the episode has ended
  return _finalise(_decode(graphdef, params, r, logits, done, key, st, skew, sequence, budget))


def _finalise(r: Rollout) -> Rollout:
  """Attach the routing to the guidance (routing replay travels with it)."""
  if r.guidance is not None and r.routing is not None:
    r = dataclasses.replace(r, guidance=dataclasses.replace(r.guidance, routing=r.routing))
  return r


POOL_CHECK_EVERY = 8  # a slot pool's decode steps between refills, by default


def stop_check_every(sampling, pool: bool = False) -> int:
  """SamplingConfig.stop_check_every, resolved: None is 8 on a GPU or in a slot pool (whose
  check also refills: a prefill, an insert and a copy out), 1 elsewhere."""
  if sampling.stop_check_every is not None:
    return sampling.stop_check_every
  if pool:
    return POOL_CHECK_EVERY
  return 8 if jax.default_backend() == "gpu" else 1
