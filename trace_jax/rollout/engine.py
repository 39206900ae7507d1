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

The jitted prefill and decode programs are `rollout.decode`; a batch of trajectories is
`rollout.trajectories.Rollout`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from trace_jax import kernels as kernels_lib
from trace_jax.model.sharding import batch_sharding, data_shards
from trace_jax.model.skew import Skew
from trace_jax.model.transformer import Transformer
from trace_jax.rollout.config import RolloutConfig
from trace_jax.rollout.decode import Statics, continue_program, generate_program
from trace_jax.rollout.params import fuse_for_kernels_jit, quantize_params_jit, sync_params
from trace_jax.rollout import pool as pool_lib
from trace_jax.rollout.trajectories import (  # noqa: F401 - the engine's public names
  FINISH_LENGTH,
  FINISH_NAMES,
  FINISH_RUNNING,
  FINISH_STOP,
  Rollout,
)
from trace_jax.utils import round_up
from trace_jax.utils.distributed import global_array


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
    bad_stops = [t for t in config.sampling.stop_tokens if not 0 <= t < cfg.vocab_size]
    if bad_stops:
      raise ValueError(f"stop_tokens {bad_stops} lie outside the vocabulary [0, {cfg.vocab_size})")
    if not 0 <= config.pad_id < cfg.vocab_size:
      raise ValueError(f"pad_id={config.pad_id} lies outside the vocabulary [0, {cfg.vocab_size})")
    shards = data_shards(mesh)
    if config.slots and config.slots % shards:
      raise ValueError(
        f"RolloutConfig.slots={config.slots} on a mesh of {shards} data shards: the slots "
        f"split over them; allowed: a multiple of {shards}"
      )
    if config.slots and mesh is not None and mesh.devices.size > len(mesh.local_devices):
      raise ValueError(
        f"RolloutConfig.slots={config.slots} on a mesh across processes: the slot pool "
        "refills from this process's host; use slots=None (the static batch) there"
      )
    self.statics = Statics.of(config, cfg, self.kernels, capture_inputs=capture_inputs, mesh=mesh)
    self._stats = pool_lib.PoolStats()
    self._pending = []  # the static engine's per-call (generated, steps) device scalars
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
    max_new_tokens: Sequence[int] | None = None,
  ) -> Rollout:
    """Sample continuations of `prompts` (token lists of any lengths).

    `sequences` (each prompt's sequence id; default 0.. B-1) key the sampling: each token is
    drawn with fold_in(fold_in(key, sequence id), position), so a sequence's tokens do not
    depend on its row or the batch. With RolloutConfig.skew > 0, `version` (the policy
    version rolling out) and `sequences` are also the counters the skew hashes with the
    positions, layers and elements (`model.skew`). `max_new_tokens`: each sequence's own
    budget of new tokens (default SamplingConfig.max_new_tokens, which bounds them).
    """
    _check_tokens(prompts, self.cfg.vocab_size, "prompts", allow_empty=False)
    ids = self._sequence_ids(sequences, len(prompts))
    budget = self._budget(max_new_tokens, len(prompts))
    skew = self._skew(version, ids)
    tokens, mask = _pad_left(prompts, self.config.prompt_bucket, self.config.pad_id)
    need = tokens.shape[1] + self.config.sampling.max_new_tokens
    if need > self.config.max_len:
      raise ValueError(
        f"the longest prompt ({max(len(p) for p in prompts)} tokens, padded to "
        f"{tokens.shape[1]}) plus max_new_tokens="
        f"{self.config.sampling.max_new_tokens} needs {need} slots; "
        f"max_len={self.config.max_len}"
      )
    if self.config.slots:
      out = pool_lib.empty_output(self.graphdef, self.params, len(prompts), self.statics)
      return self._run_pool(tokens, mask, None, None, key, ids, budget, skew, out, None, None)
    tokens, mask = self._place(tokens), self._place(mask)
    return self._count(
      None,
      generate_program(
        self.graphdef,
        self.params,
        tokens,
        mask,
        key,
        skew,
        self._place(jnp.asarray(ids)),
        self._place(jnp.asarray(budget)),
        self.statics,
      ),
    )

  def _run_pool(
    self, prefix, prefix_mask, chunk, chunk_mask, key, ids, budget, skew, out, rows, previous
  ):
    """The slot pool (`rollout.pool`) over host arrays; `previous` (a continuation's
    rollout) gives back the history slots before its observation."""
    host = lambda a: None if a is None else np.asarray(a)  # noqa: E731
    rows = np.arange(len(ids)) if rows is None else rows
    out, stats = pool_lib.run_pool(
      self, host(prefix), host(prefix_mask), host(chunk), host(chunk_mask), key, ids, budget,
      skew, out, rows,
    )  # fmt: skip
    self._stats.add(stats)
    if previous is not None:
      out = pool_lib.keep_history(previous, out, jnp.int32(prefix.shape[1]))
    return pool_lib.finalise(out)

  def _count(self, before: Rollout | None, after: Rollout) -> Rollout:
    """Note a static call's generated tokens and decode steps (read when asked for)."""
    new = after.response_lengths
    if before is not None:
      new = new - before.response_lengths
    self._pending.append((jnp.sum(new), jnp.max(new), new.shape[0], jnp.sum(new > 0)))
    return after

  def take_stats(self) -> pool_lib.PoolStats:
    """What the calls since the last `take_stats` did (generated tokens, slot-steps,
    prefilled rows and the sequences they served; seconds: the pool's own), then reset."""
    stats, self._stats = self._stats, pool_lib.PoolStats()
    for generated, steps, rows, active in jax.device_get(self._pending):
      stats.add(
        pool_lib.PoolStats(
          generated=int(generated),
          slot_steps=int(rows) * int(steps),
          prefilled=int(active),
          sequences=int(active),
        )
      )
    self._pending = []
    return stats

  @staticmethod
  def _sequence_ids(sequences, batch: int) -> np.ndarray:
    """uint32 [B] sequence ids (default 0.. B-1), checked."""
    ids = np.arange(batch) if sequences is None else np.asarray(sequences)
    if ids.shape != (batch,) or not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
      raise ValueError(
        f"sequences must be {batch} integer sequence ids >= 0, one per row; got "
        f"{np.asarray(sequences).tolist()[:8]}"
      )
    return (ids.astype(np.int64) % 2**32).astype(np.uint32)

  def _budget(self, max_new_tokens, batch: int) -> np.ndarray:
    """int32 [B] new tokens per sequence (default SamplingConfig.max_new_tokens), checked."""
    cap = self.config.sampling.max_new_tokens
    if max_new_tokens is None:
      return np.full((batch,), cap, np.int32)
    budget = np.asarray(max_new_tokens)
    if (
      budget.shape != (batch,)
      or not np.issubdtype(budget.dtype, np.integer)
      or (budget < 1).any()
      or (budget > cap).any()
    ):
      raise ValueError(
        f"max_new_tokens must be {batch} integers in [1, {cap}] (SamplingConfig."
        f"max_new_tokens), one per sequence; got {budget.tolist()[:8]}"
      )
    return budget.astype(np.int32)

  def _skew(self, version, ids: np.ndarray) -> Skew | None:
    """The `Skew` of a call (None without RolloutConfig.skew), its version checked."""
    if not self.config.skew:
      return None
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
      raise ValueError(f"version={version!r} must be an integer >= 0 (the policy version)")
    sequence = self._place(jnp.asarray(ids))
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
    max_new_tokens: Sequence[int] | None = None,
  ) -> Rollout:
    """Append each sequence's observation tokens (an empty list ends its episode) and
    keep decoding from the same cache: a multi-turn episode is one growing sequence.
    `version` and `sequences`: as `generate` was given them (the sampling keys' and the
    skew's counters); `max_new_tokens`: this turn's budget per sequence, as in `generate`.

    The cache is donated to the continuation (updated in place, not copied): `rollout`
    keeps its tokens, masks and log-probabilities, but only the returned rollout can be
    continued again.
    """
    if self.config.slots:
      return self._continue_pool(rollout, observations, key, version, sequences, max_new_tokens)
    if rollout.cache is None:
      raise ValueError("this rollout has no cache (moved to host?); continue the device one")
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(rollout.cache)):
      raise ValueError(
        "this rollout's cache was donated to an earlier continue_; continue "
        "the rollout that call returned"
      )
    ids, budget, skew, chunk, mask = self._continuation(
      rollout, observations, version, sequences, max_new_tokens
    )
    need = int(rollout.cache.index) + chunk.shape[1] + self.config.sampling.max_new_tokens
    if need > self.config.max_len:
      raise ValueError(
        f"continuing needs {need} slots (used {int(rollout.cache.index)}, "
        f"observations padded to {chunk.shape[1]}, max_new_tokens="
        f"{self.config.sampling.max_new_tokens}); max_len={self.config.max_len}"
      )
    chunk, mask = self._place(chunk), self._place(mask)
    before = rollout.without_cache()
    return self._count(
      before,
      continue_program(
        self.graphdef,
        self.params,
        rollout.without_cache(),
        rollout.cache,
        chunk,
        mask,
        key,
        skew,
        self._place(jnp.asarray(ids)),
        self._place(jnp.asarray(budget)),
        self.statics,
      ),
    )

  def _continuation(self, rollout, observations, version, sequences, max_new_tokens):
    """A continuation's checked inputs, for either engine: (sequence ids, budgets, skew,
    the observations left-padded [B, C] and their mask)."""
    if len(observations) != rollout.tokens.shape[0]:
      raise ValueError(
        f"observations for {len(observations)} sequences; the rollout has {rollout.tokens.shape[0]}"
      )
    _check_tokens(observations, self.cfg.vocab_size, "observations", allow_empty=True)
    ids = self._sequence_ids(sequences, len(observations))
    budget = self._budget(max_new_tokens, len(observations))
    chunk, mask = _pad_left(observations, self.config.prompt_bucket, self.config.pad_id)
    return ids, budget, self._skew(version, ids), chunk, mask

  def _continue_pool(self, rollout, observations, key, version, sequences, max_new_tokens):
    """`continue_` through the slot pool: each sequence with an observation enters a slot
    with its history (the slots the static engine's cache would hold: `used_slots`)
    prefilled and its observation fed after it; ended episodes are kept as they are."""
    ids, budget, skew, chunk, mask = self._continuation(
      rollout, observations, version, sequences, max_new_tokens
    )
    used = rollout.used_slots
    need = used + chunk.shape[1] + self.config.sampling.max_new_tokens
    if need > self.config.max_len:
      raise ValueError(
        f"continuing needs {need} slots (used {used}, observations padded to "
        f"{chunk.shape[1]}, max_new_tokens={self.config.sampling.max_new_tokens}); "
        f"max_len={self.config.max_len}"
      )
    previous = rollout.without_cache()
    if previous.guidance is not None:
      previous = dataclasses.replace(
        previous, guidance=dataclasses.replace(previous.guidance, routing=None)
      )
    history = np.asarray(previous.tokens)[:, :used], np.asarray(previous.mask)[:, :used]
    out = jax.tree.map(jnp.copy, previous)
    rows = np.nonzero([len(o) > 0 for o in observations])[0]
    return self._run_pool(*history, chunk, mask, key, ids, budget, skew, out, rows, previous)


def generate(
  policy: Transformer, prompts: Sequence[Sequence[int]], *, config: RolloutConfig, key: jax.Array
) -> Rollout:
  """One-off: weight sync and generation (use a RolloutEngine to reuse the synced weights)."""
  return RolloutEngine(policy, config).generate(prompts, key)
