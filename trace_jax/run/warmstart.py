"""SFT warm start: train on solver demonstrations so RL starts from a policy that sometimes
succeeds; saved once per workdir and reused.

A saved warm start is verified as RL checkpoints are (`run.checkpoint.fingerprint`): its
record holds a checksum of every array, and a reload checks the arrays against them and
that every float is finite. One that does not read or verify (a truncated or bit-flipped
file, a damaged record) is rebuilt in place from the policy's initial weights, which the
failed reload left untouched; a printed line and the returned record (`rebuilt`) say why.
A warm start saved before checksums were recorded is checked for finiteness only.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from trace_jax.model.sharding import batch_sharding
from trace_jax.rl import data, episodes
from trace_jax.rollout.engine import RolloutConfig, RolloutEngine
from trace_jax.run.checkpoint import fingerprint
from trace_jax.tasks.base import Task
from trace_jax.tasks.tokenizer import Tokenizer
from trace_jax.training.sft import sft_batch, train_sft
from trace_jax.utils import write_json
from trace_jax.utils.io import fsync_directory
from trace_jax.utils import round_up
from trace_jax.utils.distributed import global_array, is_main_process

WARMSTART_DIR = "warmstart"
LEVEL_EVERY = 10  # SFT steps between two checks of the level (`level_stop`)
LEVEL_PROBLEMS = 128  # training problems each check plays greedily


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
  stop: Callable[[int], bool] | None = None,
  length: int | None = None,
  step_seed: Callable[[int], int] | None = None,
) -> list[float]:
  """SFT `policy` in place on fresh demonstrations every step; returns the NLL per step
  (fewer than `steps` when `stop`, `train_sft`'s, ends it early). Every process draws the
  same demonstrations (from `seed` and the step) and, on a mesh, feeds its own rows of them
  (`place_sft_batch`).

  A caller with a draw of its own (a study that has always drawn its demonstrations
  otherwise) passes `length` (tokens per row; default `sft_length`) and `step_seed` (the
  demonstrations' seed at each step; default the run's, `7919 * seed + step + 1`)."""
  length = sft_length(task, tokenizer, seed) if length is None else length
  step_seed = (lambda step: 7_919 * seed + step + 1) if step_seed is None else step_seed

  def batches(step):
    pairs = data.demonstration_pairs(task, tokenizer, step_seed(step), batch)
    pairs = [(p, c) for p, c in pairs if len(p) + len(c) <= length]
    return place_sft_batch(sft_batch(pairs, length, tokenizer.pad_id), mesh)

  return train_sft(
    policy, batches, steps=steps, learning_rate=learning_rate, progress=progress, stop=stop
  )


def level_stop(
  policy,
  task: Task,
  tokenizer: Tokenizer,
  greedy: RolloutConfig,
  *,
  target: float,
  seed: int,
  checks: list,
  mesh=None,
) -> Callable[[int], bool]:
  """`train_sft`'s stop: every LEVEL_EVERY steps, the greedy FP4 reward of `policy` on
  LEVEL_PROBLEMS training problems (the same ones each time, drawn with `seed`); True once
  it reaches `target`. Each check appends [steps done, reward] to `checks`.

  Why: the SFT passes a sharp transition whose step depends on the seed (chain, small: a
  greedy evaluation of 0.37-0.43 after 100 steps, 0.66-0.84 after 150), and where RL starts
  decides how far it can rise. Stopping at a level starts every seed from about the same
  one. The problems are training problems: the held-out evaluation never steers the run.
  """
  items = task.sample(seed, LEVEL_PROBLEMS, "train")
  engine = None

  def stop(done: int) -> bool:
    nonlocal engine
    if done % LEVEL_EVERY:
      return False
    if engine is None:
      engine = RolloutEngine(policy, greedy.replace(precision="fp4"), mesh=mesh)
    else:
      engine.sync(policy)
    played = episodes.play(engine, task, tokenizer, items, jax.random.key(0))
    reward = float(np.mean(played.rewards))
    checks.append([done, reward])
    return reward >= target

  return stop


def source_settings(
  *,
  model: str,
  task_options=(),
  prompt_format: str = "auto",
  system_prompt: str = "",
  observation_role: str = "user",
  chat_template_options=(),
) -> dict:
  """What besides the task, seed and SFT settings makes a warm start: the starting model
  (a preset's name or a checkpoint's path), the task's options and how prompts are
  rendered. `experiments/sft.py` and the trainer both key their warm starts with it."""
  return {
    "model": model,
    "task_options": task_options,
    "prompt_format": prompt_format,
    "system_prompt": system_prompt,
    "observation_role": observation_role,
    "chat_template_options": chat_template_options,
  }


def _differences(saved: dict | None, wanted: dict) -> dict:
  saved = saved or {}
  return {
    k: (saved.get(k, "<not recorded>"), wanted[k])
    for k in sorted(set(saved) | set(wanted))
    if saved.get(k, "<not recorded>") != wanted.get(k, "<not recorded>")
  }


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
  source: dict,
  target: float = 0.0,
  greedy: RolloutConfig | None = None,
  progress: bool = True,
  mesh=None,
) -> dict:
  """Restore `<workdir>/warmstart` into `policy`, or run SFT (batch rows over the mesh's
  "data" axis, `place_sft_batch`) and save it there. Returns the warm start's record
  (steps run, NLLs, settings, the level checks, whether it was loaded).

  `target` > 0 stops the SFT once the greedy FP4 reward on training problems reaches it
  (`level_stop`, played with `greedy`, the run's greedy RolloutConfig); `steps` is then
  the most it runs, and the schedule's length. 0: all `steps`.

  A warm start is keyed by its settings (task, seed, SFT steps, batch, learning rate and
  target, and `source`, from `source_settings`): one saved for other settings is refused,
  naming what differs, never reused silently (a rerun in the same workdir with another
  --task or --sft_steps would otherwise start from the wrong policy).

  A saved warm start that does not read or verify (the module docstring) is rebuilt: the
  returned record's `rebuilt` says why (and a line is printed).

  Raises:
    ValueError: a warm start made with other settings; a warm start to make with a target
      but no greedy RolloutConfig (before the SFT).
  """
  # JSON's view of the settings (tuples as lists): what a saved record compares against
  settings = json.loads(
    json.dumps(
      {
        "task": task.name,
        "seed": seed,
        "sft_steps": steps,
        "sft_batch": batch,
        "sft_learning_rate": learning_rate,
        "sft_target": target,
        **source,
      }
    )
  )
  path = os.path.join(os.path.abspath(workdir), WARMSTART_DIR)
  record_path = os.path.join(path, "warmstart.json")
  checkpointer = ocp.StandardCheckpointer()
  rebuilt = None
  if os.path.exists(record_path):
    record, damage = _restore_verified(policy, path, settings, checkpointer)
    if damage is None:
      return {**_public(record), "loaded": True}
    rebuilt = damage
    if is_main_process():
      print(f"the warm start in {path} is damaged ({damage}); rebuilding it", flush=True)
  if target and greedy is None:
    raise ValueError(f"a warm start with target={target!r} needs the run's greedy RolloutConfig")
  checks: list = []
  stop = None
  if target:
    stop = level_stop(
      policy, task, tokenizer, greedy, target=target, seed=seed, checks=checks, mesh=mesh
    )
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
    stop=stop,
  )
  os.makedirs(path, exist_ok=True)
  if rebuilt is not None and is_main_process() and os.path.exists(record_path):
    os.remove(record_path)  # the damaged warm start is no longer whole while it is rebuilt
  params = nnx.to_pure_dict(nnx.state(policy))
  checksums, _ = fingerprint(params)
  checkpointer.save(os.path.join(path, "params"), params, force=True)
  checkpointer.wait_until_finished()
  fsync_directory(path)  # orbax renamed params/ into place: durable once path/ is
  record = {
    "task": task.name,
    "settings": settings,
    "steps": len(losses),
    "checks": checks,
    "first_nll": losses[0] if losses else None,
    "final_nll": float(np.mean(losses[-10:])) if losses else None,
    "checksums": checksums,
  }
  write_json(record_path, record)  # written last: its presence means the warm start is whole
  info = {**_public(record), "loaded": False}
  if rebuilt is not None:
    info["rebuilt"] = rebuilt
  return info


def _public(record: dict) -> dict:
  """The record as a run reports it (the checksums stay in the file)."""
  return {k: v for k, v in record.items() if k != "checksums"}


def _restore_verified(policy, path: str, settings: dict, checkpointer) -> tuple[dict, str | None]:
  """(record, None) with `policy` holding the saved warm start, verified; or (None, why
  it is damaged), `policy` untouched.

  Raises:
    ValueError: the warm start was made with other settings.
  """
  record_path = os.path.join(path, "warmstart.json")
  try:
    with open(record_path) as f:
      record = json.load(f)
  except Exception as e:  # noqa: BLE001
    return None, f"warmstart.json does not read: {_one_line(e)}"
  if not isinstance(record, dict):
    return None, f"warmstart.json holds a {type(record).__name__}, not a JSON object"
  differ = _differences(record.get("settings"), settings)
  if differ:
    listed = "; ".join(f"{k}: saved {a!r}, this run {b!r}" for k, (a, b) in differ.items())
    raise ValueError(
      f"the warm start in {path} was made with other settings ({listed}); delete that "
      f"directory to make one for this run, or use another --workdir"
    )
  state = nnx.state(policy)
  try:
    restored = checkpointer.restore(os.path.join(path, "params"), nnx.to_pure_dict(state))
  except Exception as e:  # noqa: BLE001 - orbax and TensorStore errors name no file
    return None, f"its arrays do not restore: {_one_line(e)}"
  checksums, nonfinite = fingerprint(restored)
  saved = record.get("checksums")
  if saved is not None:  # (None: saved before checksums were recorded; finiteness is all)
    differ = sorted(k for k in set(saved) | set(checksums) if saved.get(k) != checksums.get(k))
    if differ:
      return None, (
        f"{len(differ)} arrays differ from the checksums saved with them, e.g. {differ[:2]}"
      )
  if nonfinite:
    return None, f"it holds NaN or Inf in {nonfinite[:3]}"
  nnx.replace_by_pure_dict(state, restored)
  nnx.update(policy, state)
  return record, None


def _one_line(error: BaseException) -> str:
  first = (str(error).strip().splitlines() or [""])[0][:200]
  return f"{type(error).__name__}: {first}"
