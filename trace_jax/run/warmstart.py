"""SFT warm start: train on solver demonstrations so RL starts from a policy that sometimes
succeeds; saved once per workdir and reused."""

from __future__ import annotations

import json
import os

import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from trace_jax.model.sharding import batch_sharding
from trace_jax.rl import data
from trace_jax.tasks.base import Task
from trace_jax.tasks.tokenizer import Tokenizer
from trace_jax.training.sft import sft_batch, train_sft
from trace_jax.utils import write_json
from trace_jax.utils.io import fsync_directory
from trace_jax.utils import round_up
from trace_jax.utils.distributed import global_array

WARMSTART_DIR = "warmstart"


def sft_length(task: Task, tokenizer: Tokenizer, seed: int) -> int:
  pairs = data.demonstration_pairs(task, tokenizer, seed, 64)
  longest = max(len(p) + len(c) for p, c in pairs)
  return round_up(longest + 8, 16)


def place_sft_batch(batch: tuple, mesh) -> tuple:
  """An `sft_batch` (tokens, loss mask, valid [B, L]) split like the RL batch: rows over
  the mesh's "data" axis, each process transferring only its own rows (multi-host: each
  trains on its shard, as in the RL steps). Rows are padded to a multiple of "data" with
  empty rows (no valid token, no loss), which change neither the NLL, a mean over loss
  tokens, nor the load-balancing loss, a mean over valid tokens. No mesh: as it is."""
  if mesh is None:
    return batch
  arrays = pad_rows(batch, mesh.shape["data"])
  return tuple(global_array(a, batch_sharding(mesh, a.ndim)) for a in arrays)


def pad_rows(batch: tuple, multiple: int) -> tuple:
  """`batch`'s arrays (host copies) with empty rows (zeros: no valid token, no loss token,
  pad id 0 never read) appended up to a multiple of `multiple` rows."""
  arrays = [np.asarray(a) for a in batch]
  pad = -arrays[0].shape[0] % multiple
  if pad:
    arrays = [np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)]) for a in arrays]
  return tuple(arrays)


def run_sft(
  policy,
  task: Task,
  tokenizer: Tokenizer,
  *,
  steps: int,
  batch: int,
  seed: int,
  learning_rate: float,
  progress: bool = True,
  mesh=None,
) -> list[float]:
  """SFT `policy` in place on fresh demonstrations every step; returns the NLL per step.
  Every process draws the same demonstrations (from `seed` and the step) and, on a mesh,
  feeds its own rows of them (`place_sft_batch`)."""
  length = sft_length(task, tokenizer, seed)

  def batches(step):
    pairs = data.demonstration_pairs(task, tokenizer, 7_919 * seed + step + 1, batch)
    pairs = [(p, c) for p, c in pairs if len(p) + len(c) <= length]
    return place_sft_batch(sft_batch(pairs, length, tokenizer.pad_id), mesh)

  return train_sft(policy, batches, steps=steps, learning_rate=learning_rate, progress=progress)


def load_or_train(
  policy,
  workdir: str,
  task: Task,
  tokenizer: Tokenizer,
  *,
  steps: int,
  batch: int,
  seed: int,
  learning_rate: float,
  progress: bool = True,
  mesh=None,
) -> dict:
  """Restore `<workdir>/warmstart` into `policy`, or run SFT (batch rows over the mesh's
  "data" axis, `place_sft_batch`) and save it there. Returns the warm start's record
  (steps, NLLs, whether it was loaded)."""
  path = os.path.join(os.path.abspath(workdir), WARMSTART_DIR)
  record_path = os.path.join(path, "warmstart.json")
  checkpointer = ocp.StandardCheckpointer()
  if os.path.exists(record_path):
    state = nnx.state(policy)
    try:
      with open(record_path) as f:
        record = json.load(f)
      restored = checkpointer.restore(os.path.join(path, "params"), nnx.to_pure_dict(state))
    except Exception as e:  # noqa: BLE001 - JSON, orbax and TensorStore errors name no file
      first = (str(e).strip().splitlines() or [""])[0][:200]
      raise ValueError(
        f"the warm start in {path} is damaged ({type(e).__name__}: {first}); "
        f"delete that directory to redo the warm start"
      ) from e
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(policy, state)
    return {**record, "loaded": True}
  losses = run_sft(
    policy,
    task,
    tokenizer,
    steps=steps,
    batch=batch,
    seed=seed,
    learning_rate=learning_rate,
    progress=progress,
    mesh=mesh,
  )
  os.makedirs(path, exist_ok=True)
  checkpointer.save(os.path.join(path, "params"), nnx.to_pure_dict(nnx.state(policy)), force=True)
  checkpointer.wait_until_finished()
  fsync_directory(path)  # orbax renamed params/ into place: durable once path/ is
  record = {
    "task": task.name,
    "steps": steps,
    "first_nll": losses[0] if losses else None,
    "final_nll": float(np.mean(losses[-10:])) if losses else None,
  }
  write_json(record_path, record)  # written last: its presence means the warm start is whole
  return {**record, "loaded": False}
