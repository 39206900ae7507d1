"""SFT warm start: train on solver demonstrations so RL starts from a policy that sometimes
succeeds; saved once per workdir and reused."""

from __future__ import annotations

import json
import os

import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from trace_jax.rl import data
from trace_jax.tasks.base import Task
from trace_jax.tasks.tokenizer import Tokenizer
from trace_jax.training.sft import sft_batch, train_sft
from trace_jax.utils import write_json
from trace_jax.utils import round_up

WARMSTART_DIR = "warmstart"


def sft_length(task: Task, tokenizer: Tokenizer, seed: int) -> int:
  pairs = data.demonstration_pairs(task, tokenizer, seed, 64)
  longest = max(len(p) + len(c) for p, c in pairs)
  return round_up(longest + 8, 16)


def run_sft(policy, task: Task, tokenizer: Tokenizer, *, steps: int, batch: int, seed: int,
            learning_rate: float, progress: bool = True) -> list[float]:
  """SFT `policy` in place on fresh demonstrations every step; returns the NLL per step."""
  length = sft_length(task, tokenizer, seed)

  def batches(step):
    pairs = data.demonstration_pairs(task, tokenizer, 7_919 * seed + step + 1, batch)
    pairs = [(p, c) for p, c in pairs if len(p) + len(c) <= length]
    return sft_batch(pairs, length, tokenizer.pad_id)

  return train_sft(policy, batches, steps=steps, learning_rate=learning_rate, progress=progress)


def load_or_train(policy, workdir: str, task: Task, tokenizer: Tokenizer, *, steps: int,
                  batch: int, seed: int, learning_rate: float, progress: bool = True) -> dict:
  """Restore `<workdir>/warmstart` into `policy`, or run SFT and save it there. Returns the
  warm start's record (steps, NLLs, whether it was loaded)."""
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
      raise ValueError(f"the warm start in {path} is damaged ({type(e).__name__}: {first}); "
                       f"delete that directory to redo the warm start") from e
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(policy, state)
    return {**record, "loaded": True}
  losses = run_sft(policy, task, tokenizer, steps=steps, batch=batch, seed=seed,
                   learning_rate=learning_rate, progress=progress)
  os.makedirs(path, exist_ok=True)
  checkpointer.save(os.path.join(path, "params"), nnx.to_pure_dict(nnx.state(policy)), force=True)
  checkpointer.wait_until_finished()
  record = {"task": task.name, "steps": steps, "first_nll": losses[0] if losses else None,
            "final_nll": float(np.mean(losses[-10:])) if losses else None}
  write_json(record_path, record)  # written last: its presence means the warm start is whole
  return {**record, "loaded": False}
