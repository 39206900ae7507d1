"""The rollout engine: jitted prefill + decode loop over a KV cache, with guidance capture.

Layout of a rollout: every sequence of the batch owns slots 0..S-1 of one token buffer and
one KV cache. The prompt is left-padded into the first P slots; each decode step writes one
slot for all sequences at once (a sequence that has stopped writes an invalid slot);
multi-turn observations are fed as a left-padded chunk after the last generated slot.
Masks say which slots hold prompt, response or environment tokens; RoPE positions count
each sequence's own valid tokens, so padding and holes never shift them. The training path
runs the same [B, S] buffers, so recorded guidance lines up with it slot for slot.

  engine = RolloutEngine(policy, RolloutConfig(...))   # weight sync: quantize_params once
  rollout = engine.generate(prompts, key)              # list of token lists
  rollout = engine.continue_(rollout, observations, key)   # next turn, same cache

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
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as guidance_lib
from trace_jax import kernels as kernels_lib
from trace_jax.model.cache import init_cache
from trace_jax.model import sharding as sharding_lib
from trace_jax.model.sharding import batch_sharding
from trace_jax.model.quant import CallOptions, Recording, resolve_layers
from trace_jax.model.skew import Skew
from trace_jax.model.transformer import Transformer
from trace_jax.rollout.config import RolloutConfig
from trace_jax.rollout.params import fuse_for_kernels_jit, quantize_params_jit, sync_params
from trace_jax.rollout.sampling import sample
from trace_jax.utils import round_up
from trace_jax.utils.distributed import global_array, host_array

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = ("running", "stop", "length")


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=[
    "tokens",
    "positions",
    "prompt_mask",
    "response_mask",
    "env_mask",
    "logprobs",
    "sampling_logprobs",
    "finish",
    "guidance",
    "routing",
    "cache",
    "site_inputs",
  ],
  meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Rollout:
  """A batch of trajectories.

  Attributes:
    tokens: int32 [B, S]; slots that hold nothing have the pad id.
    positions: int32 [B, S] RoPE positions (the training path uses the same).
    prompt_mask, response_mask, env_mask: bool [B, S]: which slots hold prompt tokens,
      generated tokens (the stop token included) and environment observations.
    logprobs: float32 [B, S], log-probability of each generated token under
      softmax(logits / temperature), the full tempered distribution (0 elsewhere).
    sampling_logprobs: float32 [B, S], under the distribution actually sampled (after
      top-k / top-p; equal to `logprobs` without them; 0 for greedy).
    finish: int32 [B]: FINISH_STOP (emitted a stop token) or FINISH_LENGTH (hit
      max_new_tokens) for the last turn.
    guidance: the captured `Guidance` (or None when guidance="none" and no routing).
    routing: int8/int16 [num_moe_layers, B, S, k], the experts chosen at every slot.
    cache: the KV cache, to continue from.
    site_inputs: {(layer, site): activation [B, S, ...]} before quantization, float32 as
      the quantizer read it (its FP4 is the guidance, bit for bit), only when asked for
      (checks and studies).
  """

  tokens: jax.Array
  positions: jax.Array
  prompt_mask: jax.Array
  response_mask: jax.Array
  env_mask: jax.Array
  logprobs: jax.Array
  sampling_logprobs: jax.Array
  finish: jax.Array
  guidance: Any
  routing: Any
  cache: Any
  site_inputs: Any

  @property
  def mask(self) -> jax.Array:
    """Every slot that holds a real token."""
    return self.prompt_mask | self.response_mask | self.env_mask

  @property
  def lengths(self) -> jax.Array:
    """int32 [B]: real tokens per sequence."""
    return jnp.sum(self.mask, axis=-1, dtype=jnp.int32)

  @property
  def response_lengths(self) -> jax.Array:
    return jnp.sum(self.response_mask, axis=-1, dtype=jnp.int32)

  def finish_reasons(self) -> list[str]:
    return [FINISH_NAMES[int(f)] for f in host_array(self.finish)]

  def sequences(self) -> list[list[int]]:
    """Each sequence's real tokens, in order."""
    tokens, mask = host_array(self.tokens), host_array(self.mask)
    return [t[m].tolist() for t, m in zip(tokens, mask)]

  def responses(self) -> list[list[int]]:
    """Each sequence's generated tokens (all turns), in order."""
    tokens, mask = host_array(self.tokens), host_array(self.response_mask)
    return [t[m].tolist() for t, m in zip(tokens, mask)]

  def without_cache(self) -> "Rollout":
    return dataclasses.replace(self, cache=None)

  def trim(self, slots: int) -> "Rollout":
    """The first `slots` slots (all real tokens must lie there), without the cache."""
    per_slot = lambda a: None if a is None else a[:, :slots]
    return dataclasses.replace(
      self,
      cache=None,
      **{
        f: per_slot(getattr(self, f))
        for f in (
          "tokens",
          "positions",
          "prompt_mask",
          "response_mask",
          "env_mask",
          "logprobs",
          "sampling_logprobs",
        )
      },
      guidance=None if self.guidance is None else self.guidance.trim(slots),
      routing=None if self.routing is None else self.routing[:, :, :slots],
      site_inputs=None if self.site_inputs is None else jax.tree.map(per_slot, self.site_inputs),
    )

  @property
  def used_slots(self) -> int:
    """Slots written so far (the cache's write index)."""
    mask = host_array(self.mask)
    return int(np.nonzero(mask.any(axis=0))[0].max()) + 1 if mask.any() else 0

  def to_host(self) -> "Rollout":
    """The trajectories on the host, without the cache (which stays with the engine)."""
    return jax.device_get(self.without_cache())


# --- Inside jit ---------------------------------------------------------------------------


def _write(buffer, new, slot, axis=1):
  """Write `new` (pytree of [.., T, ..] arrays) into `buffer` at slots [slot, slot + T)."""
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


def _forward(graphdef, params, tokens, positions, mask, cache, st: "_Statics", skew=None):
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
class _Statics:
  """Hashable static arguments of the jitted functions."""

  config: RolloutConfig
  guided_layers: tuple[int, ...]
  routing_dtype: Any
  capture_inputs: bool
  kernels: str  # "pallas" or "xla": `config.kernels` resolved (outside jit) by the engine
  mesh: Any = None  # place the cache and buffers made inside jit (batch over "data")
  stop_every: int = 1  # decode steps between stop checks (SamplingConfig.stop_check_every)

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
    rollout's quantization is `config.quant`)."""
    return CallOptions(
      kernels=self.kernels, recording=self.recording, compute_dtype=self.config.compute_dtype
    )


def _captured(out, st: _Statics):
  """(guidance site entries, routing, inputs) of one forward's `ModelOutput`: the guided
  layers' records, already in the guidance's stored form."""
  routing = out.routing.astype(st.routing_dtype) if st.config.record_routing else None
  inputs = out.site_inputs if st.capture_inputs else None
  return out.sites, routing, inputs


_MASKS = {"prompt": "prompt_mask", "env": "env_mask", "response": "response_mask"}


def _feed(
  graphdef, params, r: Rollout, chunk, chunk_mask, kind: str, st: _Statics, skip=None, skew=None
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


def _decode(graphdef, params, r: Rollout, logits, done, key, st: _Statics, skew=None) -> Rollout:
  """Sample up to max_new_tokens per sequence; stop when all are done, asking every
  `st.stop_every` steps (a while loop over fixed-count chunks of steps; see the module
  docstring: the steps after the last stop of a chunk are exact no-ops)."""
  sampling = st.config.sampling
  stop_tokens = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)
  every = st.stop_every

  def body(carry):
    step, r, logits, done, finish, key = carry
    skip = jnp.all(done) if every > 1 else None
    key, sample_key = jax.random.split(key)
    token, logp, sampling_logp = sample(logits, sample_key, sampling)
    active = ~done
    stopped = active & jnp.isin(token, stop_tokens)
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
    finish = jnp.where(stopped, FINISH_STOP, finish)
    return step + 1, r, logits, done | stopped, finish, key

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


def _empty_rollout(graphdef, params, batch: int, st: _Statics) -> Rollout:
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


@functools.partial(jax.jit, static_argnums=(0, 6))
def _generate(graphdef, params, prompt, prompt_mask, key, skew, st: _Statics) -> Rollout:
  r = _empty_rollout(graphdef, params, prompt.shape[0], st)
  r, logits = _feed(graphdef, params, r, prompt, prompt_mask, "prompt", st, skew=skew)
  done = jnp.zeros((prompt.shape[0],), bool)
  return _finalise(_decode(graphdef, params, r, logits, done, key, st, skew))


# The cache is donated: a continuation writes into it in place instead of copying it (at
# long context the cache is most of a rollout's memory). `r` comes without it.
@functools.partial(jax.jit, static_argnums=(0, 8), donate_argnums=3)
def _continue(
  graphdef, params, r: Rollout, cache, chunk, chunk_mask, key, skew, st: _Statics
) -> Rollout:
  r = dataclasses.replace(r, cache=cache)
  r, logits = _feed(graphdef, params, r, chunk, chunk_mask, "env", st, skew=skew)
  done = ~jnp.any(chunk_mask, axis=-1)  # no observation: the episode has ended
  return _finalise(_decode(graphdef, params, r, logits, done, key, st, skew))


def _finalise(r: Rollout) -> Rollout:
  """Attach the routing to the guidance (routing replay travels with it)."""
  if r.guidance is not None and r.routing is not None:
    r = dataclasses.replace(r, guidance=dataclasses.replace(r.guidance, routing=r.routing))
  return r


# --- Host side ------------------------------------------------------------------------------


def _pad_left(sequences: Sequence[Sequence[int]], bucket: int, pad_id: int):
  """Left-pad token lists into int32 [B, C] (C a multiple of `bucket`) and a bool mask."""
  lengths = [len(s) for s in sequences]
  width = max(max(lengths), 1)
  width = round_up(width, bucket)
  tokens = np.full((len(sequences), width), pad_id, np.int32)
  mask = np.zeros((len(sequences), width), bool)
  for i, seq in enumerate(sequences):
    if len(seq):
      tokens[i, width - len(seq) :] = np.asarray(seq, np.int32)
      mask[i, width - len(seq) :] = True
  return jnp.asarray(tokens), jnp.asarray(mask)


def _check_tokens(sequences, vocab: int, what: str, allow_empty: bool):
  if not isinstance(sequences, (list, tuple)) or not len(sequences):
    raise ValueError(f"{what}: an empty batch; pass a non-empty list of token lists")
  for i, seq in enumerate(sequences):
    if not len(seq) and not allow_empty:
      raise ValueError(f"{what}[{i}] is empty; every prompt needs at least one token")
    bad = [t for t in seq if not 0 <= int(t) < vocab]
    if bad:
      raise ValueError(f"{what}[{i}] holds token ids {bad[:5]} outside [0, {vocab})")


class RolloutEngine:
  """Generates FP4 (or bf16) rollouts of a policy and captures TRACE guidance.

  Args:
    policy: the Transformer whose weights to roll out.
    config: RolloutConfig.
    capture_inputs: also keep every guided site's activation before quantization
      (`Rollout.site_inputs`; for checks and studies, memory-hungry).
    mesh: a device mesh whose "data" axis splits the batch (data-parallel rollouts).
  """

  def __init__(
    self, policy: Transformer, config: RolloutConfig, *, capture_inputs: bool = False, mesh=None
  ):
    self.config = config
    self.mesh = mesh
    self.cfg = policy.cfg
    # "pallas" or "xla": resolved here, outside any trace ("auto" probes the kernels once),
    # and why "auto" took XLA (None otherwise): runs record both (rl metrics, summary.json).
    self.kernels, self.kernels_fallback = kernels_lib.resolve_with_reason(config.kernels)
    logging.info(
      "rollout kernels: %s (kernels=%r%s)",
      self.kernels,
      config.kernels,
      f"; {self.kernels_fallback}" if self.kernels_fallback else "",
    )
    cfg = policy.cfg
    guided = resolve_layers(config.guided_layers, cfg.num_layers, field="guided_layers")
    bad_stops = [t for t in config.sampling.stop_tokens if not 0 <= t < cfg.vocab_size]
    if bad_stops:
      raise ValueError(f"stop_tokens {bad_stops} lie outside the vocabulary [0, {cfg.vocab_size})")
    if not 0 <= config.pad_id < cfg.vocab_size:
      raise ValueError(f"pad_id={config.pad_id} lies outside the vocabulary [0, {cfg.vocab_size})")
    self.statics = _Statics(
      config=config,
      guided_layers=guided if config.guidance != "none" else (),
      routing_dtype=guidance_lib.routing_dtype(cfg.num_experts),
      capture_inputs=capture_inputs,
      kernels=self.kernels,
      mesh=mesh,
      stop_every=stop_check_every(config.sampling),
    )
    self.graphdef = None
    self.params = None
    self.sync(policy)

  def sync(self, policy: Transformer) -> None:
    """Weight sync: re-make the rollout's (packed FP4 or bf16) weights from the policy."""
    self.graphdef, self.params = self.weights(policy)

  def weights(self, policy: Transformer) -> tuple:
    """(graphdef, params): the rollout weights `sync` makes of `policy`, without loading
    them. On a mesh they are made by `sync_params`: one program whose outputs land in
    `rollout_param_shardings` when the policy lives on this mesh's devices, else made
    where the policy lives and moved device to device (another device group's mesh)."""
    graphdef, state = nnx.split(policy)
    dtype = jnp.dtype(self.config.compute_dtype)
    if self.mesh is not None:  # experts / model slices, whole on each data replica
      return graphdef, sync_params(state, self.config.quant, self.mesh, dtype=dtype)
    params = quantize_params_jit(state, self.config.quant, dtype=dtype)
    if self.kernels == "pallas" and self.config.quant is not None:
      # q|k|v and gate|up as the one matrix each FP4 GEMM reads (kernels.layout).
      params = fuse_for_kernels_jit(params)
    return graphdef, params

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    key: jax.Array,
    *,
    version: int = 0,
    sequences: Sequence[int] | None = None,
  ) -> Rollout:
    """Sample continuations of `prompts` (token lists of any lengths).

    With RolloutConfig.skew > 0, `version` (the policy version rolling out) and `sequences`
    (each prompt's sequence id; default 0.. B-1) are the counters the skew hashes with the
    positions, layers and elements (`model.skew`); without a skew they change nothing.
    """
    _check_tokens(prompts, self.cfg.vocab_size, "prompts", allow_empty=False)
    skew = self._skew(version, sequences, len(prompts))
    tokens, mask = _pad_left(prompts, self.config.prompt_bucket, self.config.pad_id)
    need = tokens.shape[1] + self.config.sampling.max_new_tokens
    if need > self.config.max_len:
      raise ValueError(
        f"the longest prompt ({max(len(p) for p in prompts)} tokens, padded to "
        f"{tokens.shape[1]}) plus max_new_tokens="
        f"{self.config.sampling.max_new_tokens} needs {need} slots; "
        f"max_len={self.config.max_len}"
      )
    tokens, mask = self._place(tokens), self._place(mask)
    return _generate(self.graphdef, self.params, tokens, mask, key, skew, self.statics)

  def _skew(self, version, sequences, batch: int) -> Skew | None:
    """The `Skew` of a call (None without RolloutConfig.skew), its counters checked."""
    if not self.config.skew:
      return None
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
      raise ValueError(f"version={version!r} must be an integer >= 0 (the policy version)")
    ids = np.arange(batch) if sequences is None else np.asarray(sequences)
    if ids.shape != (batch,) or not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
      raise ValueError(
        f"sequences must be {batch} integer sequence ids >= 0, one per row; got "
        f"{np.asarray(sequences).tolist()[:8]}"
      )
    sequence = self._place(jnp.asarray(ids.astype(np.int64) % 2**32, jnp.uint32))
    return Skew.of(self.config.skew, int(version) % 2**32, sequence)

  def _place(self, array):
    if self.mesh is None:
      return array
    # Each process transfers only the rows its devices hold (multi-host: its own shard).
    return global_array(np.asarray(array), batch_sharding(self.mesh, array.ndim))

  def continue_(
    self,
    rollout: Rollout,
    observations: Sequence[Sequence[int]],
    key: jax.Array,
    *,
    version: int = 0,
    sequences: Sequence[int] | None = None,
  ) -> Rollout:
    """Append each sequence's observation tokens (an empty list ends its episode) and
    keep decoding from the same cache: a multi-turn episode is one growing sequence.
    `version` and `sequences`: as `generate` was given them (the skew's counters).

    The cache is donated to the continuation (updated in place, not copied): `rollout`
    keeps its tokens, masks and log-probabilities, but only the returned rollout can be
    continued again.
    """
    if rollout.cache is None:
      raise ValueError("this rollout has no cache (moved to host?); continue the device one")
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(rollout.cache)):
      raise ValueError(
        "this rollout's cache was donated to an earlier continue_; continue "
        "the rollout that call returned"
      )
    if len(observations) != rollout.tokens.shape[0]:
      raise ValueError(
        f"observations for {len(observations)} sequences; the rollout has {rollout.tokens.shape[0]}"
      )
    _check_tokens(observations, self.cfg.vocab_size, "observations", allow_empty=True)
    skew = self._skew(version, sequences, len(observations))
    chunk, mask = _pad_left(observations, self.config.prompt_bucket, self.config.pad_id)
    need = int(rollout.cache.index) + chunk.shape[1] + self.config.sampling.max_new_tokens
    if need > self.config.max_len:
      raise ValueError(
        f"continuing needs {need} slots (used {int(rollout.cache.index)}, "
        f"observations padded to {chunk.shape[1]}, max_new_tokens="
        f"{self.config.sampling.max_new_tokens}); max_len={self.config.max_len}"
      )
    chunk, mask = self._place(chunk), self._place(mask)
    return _continue(
      self.graphdef,
      self.params,
      rollout.without_cache(),
      rollout.cache,
      chunk,
      mask,
      key,
      skew,
      self.statics,
    )


def stop_check_every(sampling) -> int:
  """SamplingConfig.stop_check_every, resolved: None is 8 on a GPU, 1 elsewhere."""
  if sampling.stop_check_every is not None:
    return sampling.stop_check_every
  return 8 if jax.default_backend() == "gpu" else 1


def generate(
  policy: Transformer, prompts: Sequence[Sequence[int]], *, config: RolloutConfig, key: jax.Array
) -> Rollout:
  """One-off: weight sync and generation (use a RolloutEngine to reuse the synced weights)."""
  return RolloutEngine(policy, config).generate(prompts, key)
