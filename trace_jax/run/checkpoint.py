"""Orbax checkpoints of an RL run: policy, optimizer, reference policy, step, PRNG, metadata.

What can go wrong, and what happens:
- a crash (even SIGKILL) during a save: orbax writes each step into a temporary directory
  and renames it when complete, so a checkpoint is whole or absent; temporary directories
  a killed save leaves behind are removed when the next run opens the directory;
- a failed save (a full disk): a `CheckpointError` in one line saying which step failed and
  which earlier checkpoints remain usable; the partial directory is removed;
- Ctrl-C (KeyboardInterrupt) during a save: orbax's writer threads are waited for (left
  running, they fail with tracebacks at the interpreter's exit), the step's temporary
  directory is removed unless it was already published whole, and the interrupt goes on;
- a damaged checkpoint (a truncated or bit-flipped file): every save stores a checksum of
  each array in its metadata, and `restore_latest` verifies it (and that every float is
  finite) after reading; a checkpoint that does not restore or verify is skipped with a
  warning saying why, and the newest one that does is used. Skipped newer checkpoints are
  moved to `<directory>_unusable/` (never deleted: they may be worth inspecting), so later
  saves of those step numbers do not collide with them;
- a power loss just after a save: orbax publishes a step by renaming its temporary
  directory, and a rename is durable only once its directory is fsynced, which `save` does.

`Checkpoints(directory, read_only=True)` reads a run without writing anything to it (no
temporary directories removed, nothing set aside, no directory created): what an export of
a run that may still be running needs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from trace_jax.utils.io import fsync_directory

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
  """A checkpoint could not be saved, or no checkpoint restores; the message says which,
  where, and what to do."""


_WEIGHT_MODULUS = 65521


def _byte_weights(shape: tuple[int, ...]) -> jax.Array:
  """uint32 weights 1 + (i mod 65521) of the bytes of an array of `shape` (its bytes along
  the last axis), i the byte's row-major position, made per dimension from iotas: no array
  is flattened, so a sharded array's weights are made shard by shard where it lives."""
  m = jnp.uint32(_WEIGHT_MODULUS)
  weights = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = jax.lax.broadcasted_iota(jnp.uint32, shape, dim) % m
    # (both factors < 65521: the product and the sum stay below 2^32)
    weights = (weights + index * jnp.uint32(stride % _WEIGHT_MODULUS)) % m
    stride *= shape[dim]
  return weights + jnp.uint32(1)


def _leaf_summary(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(checksum, all finite) of one array.

  The checksum is a position-weighted sum of its bytes (row-major order) modulo 2^32
  (weights 1..65521): a single flipped bit changes one byte by +-2^k (k < 8) at weight
  w < 2^16, a change of less than 2^24 that cannot vanish modulo 2^32, so every one-bit
  error is caught. Elementwise products and one sum: a sharded array is summed shard by
  shard, only the partial sums move.
  """
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  data = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
  return jnp.sum(data * _byte_weights(data.shape), dtype=jnp.uint32), finite


@jax.jit
def _summaries(leaves: list) -> list:
  return [_leaf_summary(x) for x in leaves]


def fingerprint(tree) -> tuple[dict[str, int], list[str]]:
  """({leaf path: checksum}, [paths of float leaves holding NaN or Inf]) of a pytree."""
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(tree)[0]) or ((), ())
  summaries = jax.device_get(_summaries([jnp.asarray(x) for x in leaves]))
  names = [jax.tree_util.keystr(p) for p in paths]
  checksums = {name: int(s[0]) for name, s in zip(names, summaries)}
  nonfinite = [name for name, s in zip(names, summaries) if not bool(s[1])]
  return checksums, nonfinite


def _short(error: BaseException) -> str:
  """One line of an exception (orbax / TensorStore errors run to pages)."""
  text = str(error).strip().splitlines()
  first = text[0] if text else ""
  return f"{type(error).__name__}: {first[:240]}"


def _is_disk_full(error: BaseException) -> bool:
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    text = str(error)
    if "No space left on device" in text or "ENOSPC" in text or "Disk quota exceeded" in text:
      return True
    error = error.__cause__ or error.__context__
  return False


class _DropOrbaxLogs(logging.Filter):
  """Drops orbax's own log records: a failing save logs the same error from every one of
  its threads, with tracebacks (pages); our exception says it once."""

  def filter(self, record: logging.LogRecord) -> bool:
    return f"{os.sep}orbax{os.sep}" not in record.pathname


def _drop_closed_loop_noise() -> None:
  """After a failed save, TensorStore completes leftover writes into orbax's closed event loop
  and Python prints each resulting `RuntimeError: Event loop is closed` (an unraisable
  exception, possibly after the save returned). Drop exactly those; keep every other one."""
  previous = sys.unraisablehook
  if getattr(previous, "_drops_closed_loop", False):
    return

  def hook(unraisable):
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      return
    previous(unraisable)

  hook._drops_closed_loop = True
  sys.unraisablehook = hook


@contextlib.contextmanager
def _quiet_orbax():
  _drop_closed_loop_noise()
  loggers = [logging.getLogger("absl"), logging.getLogger()]
  drop = _DropOrbaxLogs()
  for logger in loggers:
    logger.addFilter(drop)
  try:
    yield
  finally:
    for logger in loggers:
      logger.removeFilter(drop)


def _join_orbax_threads(running: set, timeout_s: float = 60.0) -> None:
  """Wait for the orbax threads started since `running` was taken: after one write fails,
  the others keep writing into the temporary directory for a while."""
  deadline = time.time() + timeout_s
  for thread in set(threading.enumerate()) - running:
    if type(thread).__module__.startswith("orbax") or "orbax" in thread.name:
      try:
        thread.join(max(0.0, deadline - time.time()))
      except Exception:  # noqa: BLE001 - orbax's threads re-raise their error on join
        pass


class Checkpoints:
  """Numbered checkpoints under `<directory>` (made absolute: orbax requires it)."""

  def __init__(self, directory: str, max_to_keep: int = 2, *, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    self.max_to_keep = max_to_keep
    self.read_only = read_only  # reads only: no cleanup, no set-aside, no save
    self.skipped: list[tuple[int, str]] = []  # (step, why) of checkpoints restore passed over
    self._open()

  def _open(self) -> None:
    if self.read_only:
      with _quiet_orbax():  # (orbax warns that a read-only manager saves nothing)
        self.manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(
            read_only=True, create=False, enable_async_checkpointing=False
          ),
          # The pytree handler restores a part of the state (`restore(partial=True)`).
          item_handlers={
            "state": ocp.PyTreeCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
          },
        )
      return
    self._remove_stale_temporaries()
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=self.max_to_keep,
        create=True,
        # `save` waits for the write anyway; synchronous saves fail inside `save`,
        # not in background threads that outlive it.
        enable_async_checkpointing=False,
      ),
    )

  def _remove_stale_temporaries(self) -> None:
    """Delete the temporary directories of saves that never finished (a killed run).

    Done here, synchronously, rather than by orbax's `cleanup_tmp_directories`, which runs
    in a background thread that fails noisily when the process exits soon after.
    """
    if jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if ".orbax-checkpoint-tmp" in name:
        log.warning(
          "removing %s, left by a save that never finished", os.path.join(self.directory, name)
        )
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps on disk, newest first."""
    return sorted(self.manager.all_steps(), reverse=True)

  def save(self, step: int, state: dict[str, Any], meta: dict) -> None:
    """`state`: pytrees of arrays ({"policy": nnx.State, ...}); `meta`: JSON.

    Raises:
      CheckpointError: the save failed (naming the step, the directory, the cause in one
        line and the checkpoints still usable); nothing partial is left behind.
    """
    if self.read_only:
      raise ValueError(f"Checkpoints({self.directory!r}) is read-only; it saves nothing")
    pure = {k: nnx.to_pure_dict(v) if isinstance(v, nnx.State) else v for k, v in state.items()}
    checksums, _ = fingerprint(pure)
    meta = {**meta, "checksums": checksums}
    running = set(threading.enumerate())
    try:
      with _quiet_orbax():
        self.manager.save(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardSave(pure), meta=ocp.args.JsonSave(meta)),
        )
        self.manager.wait_until_finished()
      # orbax renamed the step's temporary directory into place: make the rename (and a
      # first save's new directory) durable.
      fsync_directory(self.directory)
      fsync_directory(os.path.dirname(self.directory))
    except KeyboardInterrupt:
      self._interrupted(step, running)
      raise
    except Exception as e:  # noqa: BLE001 - any failure of the save is reported the same way
      with _quiet_orbax():  # its other writer threads fail (and log) after the first error
        _join_orbax_threads(running)
      self._remove_partial(step)
      self._open()
      usable = [s for s in self.all_steps() if s != step]
      cause = "no space left on device" if _is_disk_full(e) else _short(e)
      after = (
        f"the previous checkpoints (steps {usable}) are intact; a rerun resumes from "
        f"step {usable[0]}"
        if usable
        else "there is no earlier checkpoint"
      )
      raise CheckpointError(
        f"could not save checkpoint step {step} in {self.directory}: "
        f"{cause}; {after}. Free space (or fix the cause) and rerun."
      ) from e

  def _interrupted(self, step: int, running: set) -> None:
    """After Ctrl-C in `save`: its writers finished, an unpublished step's temporary directory
    removed (a published one, renamed into place, is whole and kept), the steps re-read."""
    with _quiet_orbax():
      _join_orbax_threads(running)
    if os.path.isdir(self.directory):
      for name in os.listdir(self.directory):
        if name.startswith(f"{step}.") and "tmp" in name:
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    self._open()

  def _remove_partial(self, step: int) -> None:
    """Delete what a failed save of `step` left (its temporary or half-renamed directory)."""
    if not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if name == str(step) or (name.startswith(f"{step}.") and "tmp" in name):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def read_meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, like: dict[str, Any]) -> dict[str, Any]:
    """Restore and verify step `step` into the structure of `like` (nnx.States are updated
    in place and returned). A read-only `Checkpoints` restores just the entries `like`
    names (e.g. {"policy": ...} without the optimizer), verified against their checksums.

    Raises:
      CheckpointError: the arrays do not match the checksums saved with them, or hold NaN.
      Anything orbax raises for an unreadable checkpoint.
    """
    pure = {k: nnx.to_pure_dict(v) if isinstance(v, nnx.State) else v for k, v in like.items()}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, pure)
    if self.read_only:
      args = ocp.args.PyTreeRestore(
        abstract,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True,
      )
      restored = self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]
      restored = jax.tree.map(jnp.asarray, restored)
    else:
      restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
      )["state"]
    self._verify(step, restored, partial=self.read_only)
    out = {}
    for k, v in like.items():
      if isinstance(v, nnx.State):
        nnx.replace_by_pure_dict(v, restored[k])
        out[k] = v
      else:
        out[k] = restored[k]
    return out

  def _verify(self, step: int, restored: dict, partial: bool = False) -> None:
    saved = self.read_meta(step).get("checksums")
    checksums, nonfinite = fingerprint(restored)
    if saved is not None and partial:  # only the entries restored
      saved = {k: v for k, v in saved.items() if any(k.startswith(f"[{r!r}]") for r in restored)}
    # Damage first: a flipped bit can also make a NaN, and "damaged files" is the diagnosis.
    if saved is not None:  # (None: written before checksums existed; finiteness is all)
      differ = sorted(k for k in set(saved) | set(checksums) if saved.get(k) != checksums.get(k))
      if differ:
        raise CheckpointError(
          f"step {step}: {len(differ)} arrays differ from the checksums "
          f"saved with them (damaged files), e.g. {differ[:2]}"
        )
    if nonfinite:
      raise CheckpointError(f"step {step} holds NaN or Inf in {nonfinite[:3]}")

  def restore_latest(self, like: dict[str, Any]) -> tuple[int, dict, dict] | None:
    """The newest checkpoint that restores and verifies: (step, restored state, meta).

    Newer ones that fail are skipped with a warning saying why (listed in `self.skipped`)
    and moved to `<directory>_unusable/`; None when the directory holds no checkpoint.

    Raises:
      CheckpointError: checkpoints exist but none restores (all are left where they are).
    """
    self.skipped = []
    steps = self.all_steps()
    for step in steps:
      try:
        with _quiet_orbax():
          restored = self.restore(step, like)
          meta = self.read_meta(step)
      except Exception as e:  # noqa: BLE001 - a damaged checkpoint fails in many ways
        reason = _short(e)
        self.skipped.append((step, reason))
        log.warning(
          "checkpoint step %d in %s does not restore (%s); trying an older one",
          step,
          self.directory,
          reason,
        )
        continue
      if not self.read_only:
        for bad, _ in self.skipped:
          self._set_aside(bad)
        if self.skipped:
          self._open()
      return step, restored, meta
    if steps:
      reasons = "; ".join(f"step {s}: {r}" for s, r in self.skipped)
      raise CheckpointError(
        f"no checkpoint in {self.directory} restores ({reasons}). Move that "
        f"directory away to start over, or use another --workdir."
      )
    return None

  def _set_aside(self, step: int) -> None:
    """Move an unusable checkpoint out of the manager's directory (kept for inspection)."""
    target = os.path.join(f"{self.directory}_unusable", f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.move(os.path.join(self.directory, str(step)), target)
    for directory in (self.directory, os.path.dirname(target), os.path.dirname(self.directory)):
      fsync_directory(directory)
    log.warning("moved the unusable checkpoint step %d to %s", step, target)
