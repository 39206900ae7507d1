"""Orbax checkpoints of an RL run: policy, optimizer, reference policy, step, PRNG, metadata.

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint is either whole or absent; a failed save raises (it is never silently dropped).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx


class Checkpoints:
  """Numbered checkpoints under `<directory>` (made absolute: orbax requires it)."""

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: dict[str, Any], meta: dict) -> None:
    """`state`: pytrees of arrays ({"policy": nnx.State, ...}); `meta`: JSON."""
    pure = {k: nnx.to_pure_dict(v) if isinstance(v, nnx.State) else v for k, v in state.items()}
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(pure),
                                                     meta=ocp.args.JsonSave(meta)))
    self.manager.wait_until_finished()

  def read_meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, like: dict[str, Any]) -> dict[str, Any]:
    """Restore into the structure of `like` (nnx.States are updated in place and returned)."""
    pure = {k: nnx.to_pure_dict(v) if isinstance(v, nnx.State) else v for k, v in like.items()}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, pure)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
    out = {}
    for k, v in like.items():
      if isinstance(v, nnx.State):
        nnx.replace_by_pure_dict(v, restored[k])
        out[k] = v
      else:
        out[k] = restored[k]
    return out
