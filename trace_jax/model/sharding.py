"""Partition specs over the mesh axes ("data", "expert", "model") and helpers to apply them.

Batch is split over "data"; routed experts over "expert" (each device holds E / n experts);
the hidden widths of attention and feed-forward weights over "model" (Megatron-style:
column-split in, row-split out). Router, norms and the shared-expert gate are replicated.
A dimension that the axis does not divide stays unsplit. Meshes use Auto axes, so XLA
inserts the collectives (GSPMD).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "expert", "model")

# Parameter name -> spec by its role; experts are the 3-D [E, in, out] weights.
_SPECS_2D = {
    "embed": P("model", None),
    "lm_head": P(None, "model"),
    "q_proj": P(None, "model"),
    "k_proj": P(None, "model"),
    "v_proj": P(None, "model"),
    "o_proj": P("model", None),
    "w_gate": P(None, "model"),
    "w_up": P(None, "model"),
    "w_down": P("model", None),
}
_SPECS_3D = {
    "w_gate": P("expert", None, "model"),
    "w_up": P("expert", None, "model"),
    "w_down": P("expert", "model", None),
}


def make_mesh(data: int = 1, expert: int = 1, model: int = 1, devices=None) -> Mesh:
  """A (data, expert, model) mesh with Auto axes over the first data*expert*model devices."""
  devices = jax.devices() if devices is None else devices
  need = data * expert * model
  if need > len(devices) or min(data, expert, model) < 1:
    raise ValueError(f"mesh data={data} x expert={expert} x model={model} needs {need} devices; "
                     f"{len(devices)} available")
  grid = np.asarray(devices[:need]).reshape(data, expert, model)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def param_spec(path: tuple, shape: tuple[int, ...]) -> P:
  """The PartitionSpec of the parameter at `path` (its NNX state path)."""
  name = str(path[-1])
  table = _SPECS_3D if len(shape) == 3 else _SPECS_2D
  return table.get(name, P())


def _fit(spec: P, shape, mesh: Mesh) -> P:
  """Drop mesh axes that do not divide their dimension."""
  axes = []
  for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes.append(axis if axis is None or dim % mesh.shape[axis] == 0 else None)
  return P(*axes)


def param_shardings(model: nnx.Module, mesh: Mesh):
  """An nnx.State of NamedShardings matching the model's parameters."""
  state = nnx.state(model)
  flat = nnx.to_flat_state(state)
  shardings = []
  for path, variable in flat:
    value = variable.get_value()
    spec = _fit(param_spec(path, value.shape), value.shape, mesh)
    shardings.append((path, variable.replace(NamedSharding(mesh, spec))))
  return nnx.from_flat_state(shardings)


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
  """Place the model's parameters on `mesh` by `param_spec` (in place; returns the model)."""
  state = nnx.state(model)
  shardings = param_shardings(model, mesh)
  nnx.update(model, jax.device_put(state, shardings))
  return model


def batch_sharding(mesh: Mesh, ndim: int = 2, axis: int = 0) -> NamedSharding:
  """Shard the batch axis (`axis`, leading by default) over "data"."""
  spec = [None] * ndim
  spec[axis] = "data"
  return NamedSharding(mesh, P(*spec))
