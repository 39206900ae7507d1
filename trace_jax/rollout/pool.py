"""A fixed pool of decode slots, refilled as sequences finish (continuous batching).

The static engine (`rollout.decode`) decodes every sequence of a call as one batch until
the longest stops, with every sequence's KV cache held at once. The pool holds
`RolloutConfig.slots` sequences instead (JetStream / MaxText inference: prefill, insert into
a free decode slot, generate):

1. Waiting sequences take the free slots in the caller's order. Their prompts are prefilled
   (chunked, as the static engine does) by one program; consecutive identical prompts (a
   GRPO group's G samples) are prefilled once and the row is copied into each of their
   slots: cache rows, positions, masks and the guidance and routing records of the prompt.
   A group whose samples enter over several refills keeps its prefilled row (one row, no
   more) until its last sample has entered.
2. Every slot decodes one token per step at its own cache index (`KVCache.index` [S]); each
   token is drawn with `sequence_keys(key, sequence id, position)`, so a sequence gets the
   tokens it gets in the static batch, whatever its slot, neighbours or the pool's size.
3. Every `stop_check_every` steps the host reads which slots finished (a stop token or the
   sequence's own budget), copies their rows into the output (the caller's row) and
   refills them (1.).

A sequence's row in the pool has the static batch's layout (its prompt left-padded to the
call's common width, its response after it), so the output is the static engine's Rollout
per sequence. A multi-turn continuation enters the same way: its history (the previous
rollout's slots) is prefilled as a prompt, its observation fed after it; the history's
records are the previous rollout's own. All programs have fixed shapes (the prefill and
copy batches are rounded up to powers of two), so a refill compiles nothing new.

On a mesh the slots are split over "data" (RolloutConfig.slots a multiple of its size), as a
static batch is, and each prefill's rows too (rounded up to a multiple of it); the weights
lie as the static engine's do.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.model.sharding import data_shards
from trace_jax.rollout.decode import (
  Statics,
  _empty_rollout,
  _feed,
  _feed_prompt,
  _finalise,
  _write,
)
from trace_jax.rollout.sampling import sample, sequence_keys
from trace_jax.rollout.trajectories import FINISH_LENGTH, FINISH_RUNNING, FINISH_STOP, Rollout
from trace_jax.utils import round_up

_PER_SLOT = ("tokens", "positions", "prompt_mask", "response_mask", "env_mask", "logprobs")
_PER_SLOT += ("sampling_logprobs",)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["r", "logits", "done", "finish", "steps", "budget", "sequence"],
  meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class PoolState:
  """The decode slots: `r` holds S rows of max_len slots (its cache index [S], one per
  slot); per slot the next token's logits [S, V], whether it is done (a free slot is),
  how its turn ended, tokens generated this turn, its budget and its sequence id."""

  r: Rollout
  logits: jax.Array
  done: jax.Array
  finish: jax.Array
  steps: jax.Array
  budget: jax.Array
  sequence: jax.Array


def _rows_map(fn, a: Rollout, b: Rollout, cache: bool) -> dict:
  """{field: fn(a's, b's, batch axis)} over every per-row field of two rollouts (the
  guidance's sites, the routing by layer, the cache's stacks when `cache`)."""
  by_axis = lambda x, y, axis: jax.tree.map(lambda p, q: fn(p, q, axis), x, y)  # noqa: E731
  out = {f: by_axis(getattr(a, f), getattr(b, f), 0) for f in _PER_SLOT + ("site_inputs",)}
  out["finish"] = fn(a.finish, b.finish, 0)
  if a.guidance is not None:
    out["guidance"] = dataclasses.replace(
      a.guidance, sites=by_axis(a.guidance.sites, b.guidance.sites, 0), routing=None
    )
  if a.routing is not None:
    out["routing"] = fn(a.routing, b.routing, 1)
  if cache:
    ac, bc = a.cache, b.cache
    out["cache"] = dataclasses.replace(
      ac,
      k=by_axis(ac.k, bc.k, 1),
      v=by_axis(ac.v, bc.v, 1),
      conv=by_axis(ac.conv, bc.conv, 1),
      recurrent=by_axis(ac.recurrent, bc.recurrent, 1),
      valid=fn(ac.valid, bc.valid, 0),
      index=fn(ac.index, jnp.broadcast_to(bc.index, (bc.valid.shape[0],)), 0),
    )
  return out


def _scatter(dst_rows, src_rows):
  """fn(into, from, axis): `into` with rows dst_rows set to rows src_rows of `from` (a
  destination past the end is a padding entry, dropped)."""

  def put(into, source, axis):
    taken = jnp.moveaxis(jnp.take(source, src_rows, axis=axis, mode="clip"), axis, 0)
    moved = jnp.moveaxis(into, axis, 0).at[dst_rows].set(taken.astype(into.dtype), mode="drop")
    return jnp.moveaxis(moved, 0, axis)

  return put


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def empty_pool(graphdef, params, slots: int, st: Statics) -> PoolState:
  """S free slots: empty rows, cache index 0 each."""
  r = _empty_rollout(graphdef, params, slots, st)
  r = dataclasses.replace(r, cache=dataclasses.replace(r.cache, index=jnp.zeros(slots, jnp.int32)))
  vocab = nnx.merge(graphdef, params).cfg.vocab_size
  zeros = lambda dtype: jnp.zeros((slots,), dtype)  # noqa: E731
  return PoolState(
    r=r,
    logits=jnp.zeros((slots, vocab), jnp.float32),
    done=jnp.ones((slots,), bool),
    finish=zeros(jnp.int32),
    steps=zeros(jnp.int32),
    budget=zeros(jnp.int32),
    sequence=zeros(jnp.uint32),
  )


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def empty_output(graphdef, params, rows: int, st: Statics) -> Rollout:
  """Empty output rows (no cache: XLA drops the one `_empty_rollout` makes)."""
  r = _empty_rollout(graphdef, params, rows, st)
  return dataclasses.replace(r, cache=None)


@functools.partial(jax.jit, static_argnums=(0, 7))
def prefill_program(graphdef, params, prompt, prompt_mask, chunk, chunk_mask, skew, st: Statics):
  """Prefill n rows: the prompt [n, W] (chunked), then an observation chunk [n, C] if one is
  given (a continuation). Returns the rows (scalar cache index) and their next logits."""
  r = _empty_rollout(graphdef, params, prompt.shape[0], st)
  r, logits = _feed_prompt(graphdef, params, r, prompt, prompt_mask, st, skew=skew)
  if chunk is not None:
    r, logits = _feed(graphdef, params, r, chunk, chunk_mask, "env", st, skew=skew)
  return r, logits


@functools.partial(jax.jit, donate_argnums=0)
def insert_program(pool: PoolState, new: Rollout, logits, slots, src, budget, sequence):
  """Slots `slots` [k] (k a bucket; S for padding) take prefilled row src[j] of `new` with
  its logits, budget and sequence id: the whole row, its cache index too."""
  put = _scatter(slots, src)
  r = dataclasses.replace(pool.r, **_rows_map(put, pool.r, new, cache=True))
  at = lambda a, v: a.at[slots].set(v, mode="drop")  # noqa: E731
  return PoolState(
    r=r,
    logits=put(pool.logits, logits, 0),
    done=at(pool.done, False),
    finish=at(pool.finish, FINISH_RUNNING),
    steps=at(pool.steps, 0),
    budget=at(pool.budget, budget),
    sequence=at(pool.sequence, sequence),
  )


@jax.jit
def take_row(new: Rollout, logits, row):
  """Row `row` of a prefill's rows (its scalar cache index kept): a group's prefilled prompt,
  kept for its samples that enter the pool in a later refill."""
  take = lambda a, _, axis: a if a.ndim == 0 else jax.lax.dynamic_slice_in_dim(a, row, 1, axis)  # noqa: E731
  fields = _rows_map(take, new, new, cache=True)
  fields["cache"] = dataclasses.replace(fields["cache"], index=new.cache.index)
  return dataclasses.replace(new, **fields), jax.lax.dynamic_slice_in_dim(logits, row, 1, 0)


@functools.partial(jax.jit, donate_argnums=0)
def extract_program(out: Rollout, pool: PoolState, slots, rows):
  """Output rows `rows` [k] (N for padding) take pool slots `slots` [k], finish included."""
  put = _scatter(rows, slots)
  source = dataclasses.replace(pool.r, finish=pool.finish)
  return dataclasses.replace(out, **_rows_map(put, out, source, cache=False))


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=2)
def decode_program(graphdef, params, pool: PoolState, key, skew, steps: int, st: Statics):
  """`steps` decode steps of every slot, a fixed-count loop (no host sync between them):
  an active slot draws its next token with its sequence's key, writes it at its own cache
  index and advances it; a done slot writes an invalid slot and stays where it is."""
  sampling = st.config.sampling
  stop_tokens = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)

  def body(_, pool):
    r = pool.r
    position = jnp.sum(r.mask, axis=-1, dtype=jnp.int32)
    keys = sequence_keys(key, pool.sequence, position)
    token, logp, sampling_logp = sample(pool.logits, keys, sampling)
    active = ~pool.done
    stopped = active & jnp.isin(token, stop_tokens)
    exhausted = active & ~stopped & (pool.steps + 1 >= pool.budget)
    slot = r.cache.index
    r = dataclasses.replace(
      r,
      logprobs=_write(r.logprobs, jnp.where(active, logp, 0.0)[:, None], slot),
      sampling_logprobs=_write(
        r.sampling_logprobs, jnp.where(active, sampling_logp, 0.0)[:, None], slot
      ),
    )
    row_skew = None if skew is None else skew.replace(sequence=pool.sequence)
    r, logits = _feed(
      graphdef, params, r, token[:, None], active[:, None], "response", st, None, row_skew
    )
    r = dataclasses.replace(
      r, cache=dataclasses.replace(r.cache, index=jnp.where(active, slot + 1, slot))
    )
    finish = jnp.where(stopped, FINISH_STOP, jnp.where(exhausted, FINISH_LENGTH, pool.finish))
    return dataclasses.replace(
      pool,
      r=r,
      logits=logits,
      done=pool.done | stopped | exhausted,
      finish=finish,
      steps=pool.steps + active,
    )

  return jax.lax.fori_loop(0, steps, body, pool)


@functools.partial(jax.jit, donate_argnums=1)
def keep_history(previous: Rollout, out: Rollout, used) -> Rollout:
  """`out` with slots before `used` taken from `previous` (a continuation's history: its
  records are the previous turns' own, not the re-prefill's), then routing attached."""

  def keep(new, old, axis):
    if new.ndim < axis + 2:  # no slot axis (the finish reasons)
      return new
    slot = jnp.arange(new.shape[axis + 1]).reshape((-1,) + (1,) * (new.ndim - axis - 2))
    return jnp.where(slot < used, old, new)

  fields = _rows_map(lambda n, o, axis: keep(n, o, axis), out, previous, cache=False)
  fields["finish"] = out.finish
  return dataclasses.replace(out, **fields)


@dataclasses.dataclass
class PoolStats:
  """What a pool (or static) rollout did: tokens generated, slot-steps run (slots x decode
  steps), wall seconds, prompt rows prefilled and sequences they served."""

  generated: int = 0
  slot_steps: int = 0
  seconds: float = 0.0
  prefilled: int = 0
  sequences: int = 0

  def add(self, other: "PoolStats") -> None:
    for field in dataclasses.fields(self):
      setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

  def metrics(self) -> dict[str, float]:
    """rollout/slot_utilization (generated tokens / slot-steps), rollout/tokens_per_second
    and rollout/prefill_shared_frac (sequences whose prompt another one's prefill served)."""
    return {
      "rollout/slot_utilization": self.generated / max(self.slot_steps, 1),
      "rollout/tokens_per_second": self.generated / max(self.seconds, 1e-9),
      "rollout/prefill_shared_frac": 1.0 - self.prefilled / max(self.sequences, 1),
    }


def _bucket(n: int) -> int:
  """n rounded up to a power of two (the prefill and copy batches: few shapes)."""
  return 1 << max(n - 1, 0).bit_length()


def run_pool(
  engine,
  prefix: np.ndarray,
  prefix_mask: np.ndarray,
  chunk: np.ndarray | None,
  chunk_mask: np.ndarray | None,
  key: jax.Array,
  ids: np.ndarray,
  budget: np.ndarray,
  skew,
  out: Rollout,
  rows: np.ndarray,
) -> tuple[Rollout, PoolStats]:
  """Decode sequences `rows` (of the output's N) through `engine.config.slots` slots.

  Args:
    prefix, prefix_mask: [N, W] each sequence's left-padded prompt (or history).
    chunk, chunk_mask: [N, C] a continuation's observations, or None.
    ids, budget: [N] sequence ids and new-token budgets.
    skew: the engine's `Skew` template (its `sequence` replaced per row), or None.
    out: the output rollout (N rows, no cache), donated: it comes back filled.
    rows: which sequences to decode, in order (a continuation skips ended episodes).
  """
  start = time.perf_counter()
  st, config = engine.statics, engine.config
  slots, every = config.slots, st.stop_every
  n_rows = prefix.shape[0]
  stats = PoolStats()
  pool = empty_pool(engine.graphdef, engine.params, slots, st)
  # Consecutive identical prompts share a prefill (never under a skew: it hashes the row).
  share = chunk is None and not config.skew
  group = np.zeros(n_rows, np.int64)
  for i in range(1, n_rows):
    same = share and np.array_equal(prefix[i], prefix[i - 1])
    same = same and np.array_equal(prefix_mask[i], prefix_mask[i - 1])
    group[i] = group[i - 1] + (0 if same else 1)
  waiting = collections.deque(int(i) for i in rows)
  occupant = np.full(slots, -1, np.int64)
  pad = lambda a, n, fill: np.concatenate([a, np.full(n - len(a), fill, a.dtype)])  # noqa: E731

  def skew_of(sequence):
    return None if skew is None else skew.replace(sequence=jnp.asarray(sequence))

  # A group's prefilled row, kept while its later samples wait: (group, row, logits).
  kept = None

  def insert(pool, new, logits, at, src, taken):
    k = _bucket(len(taken))
    return insert_program(
      pool,
      new,
      logits,
      jnp.asarray(pad(at, k, slots)),
      jnp.asarray(pad(np.asarray(src), k, 0)),
      jnp.asarray(pad(budget[taken], k, 1)),
      jnp.asarray(pad(ids[taken], k, 0)),
    )

  while waiting or (occupant >= 0).any():
    free = np.nonzero(occupant < 0)[0]
    if waiting and len(free):
      taken = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
      at = free[: len(taken)]
      # the kept group's samples enter from its row; the others are prefilled
      n_kept = 0
      while kept is not None and n_kept < len(taken) and group[taken[n_kept]] == kept[0]:
        n_kept += 1
      if n_kept:
        pool = insert(pool, kept[1], kept[2], at[:n_kept], [0] * n_kept, taken[:n_kept])
      rest = taken[n_kept:]
      if rest:
        unique, src = [], []
        for i in rest:
          if not unique or group[unique[-1]] != group[i]:
            unique.append(i)
          src.append(len(unique) - 1)
        # the rows a prefill runs: a bucket that splits over the mesh's "data" shards
        width = round_up(_bucket(len(unique)), data_shards(st.mesh))
        rows_in = pad(np.asarray(unique), width, unique[0])
        new, logits = prefill_program(
          engine.graphdef,
          engine.params,
          jnp.asarray(prefix[rows_in]),
          jnp.asarray(prefix_mask[rows_in]),
          None if chunk is None else jnp.asarray(chunk[rows_in]),
          None if chunk is None else jnp.asarray(chunk_mask[rows_in]),
          skew_of(ids[rows_in]),
          st,
        )
        pool = insert(pool, new, logits, at[n_kept:], src, rest)
        stats.prefilled += len(unique)
        last = rest[-1]
        if waiting and group[waiting[0]] == group[last]:  # the group goes on in a later refill
          kept = (group[last], *take_row(new, logits, jnp.int32(len(unique) - 1)))
      if kept is not None and not (waiting and group[waiting[0]] == kept[0]):
        kept = None  # its last sample entered
      occupant[at] = taken
      stats.sequences += len(taken)
    pool = decode_program(engine.graphdef, engine.params, pool, key, skew_of(ids[:1]), every, st)
    stats.slot_steps += slots * every
    done, steps = jax.device_get((pool.done, pool.steps))  # the host check: one sync
    finished = np.nonzero((occupant >= 0) & done)[0]
    if len(finished):
      k = _bucket(len(finished))
      out = extract_program(
        out,
        pool,
        jnp.asarray(pad(finished, k, 0)),
        jnp.asarray(pad(occupant[finished], k, n_rows)),
      )
      stats.generated += int(steps[finished].sum())
      occupant[finished] = -1
  jax.block_until_ready(out)
  stats.seconds = time.perf_counter() - start
  return out, stats


def finalise(r: Rollout) -> Rollout:
  """The output with the routing attached to the guidance (as the static engine's)."""
  return _finalise(r)
