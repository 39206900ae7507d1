"""Where every array lives on a (data, expert, model) mesh: rules each parameter declares.

  master weights, optimizer state  FSDP over "data" (the d_model side of every matrix),
                                   routed experts over "expert", attention heads and
                                   feed-forward widths over "model" (Megatron: column-split
                                   in, row-split out);
  FP4 rollout weights              the same without "data": each data-parallel rollout
                                   replica holds its experts / model slice whole, so a
                                   decode step gathers no weights;
  KV cache, recurrent state        batch over "data", KV / value heads over "model";
  guidance                         batch over "data", and over "model" where its activation
                                   is (`guidance_site_specs`);
  batches                          batch over "data".

Rules are explicit, not inferred: every parameter declares, where its module makes it, the
mesh axis of each dimension (`parameters.param(sharding=...)`, flax's `out_sharding`
metadata) and, for attention projections, its head count. A rule that asks for an axis
whose size does not divide the dimension raises a ValueError naming the parameter, the
dimension and the mesh, before anything is placed (a silently replicated array is the
failure this module exists to prevent); a parameter that declares no rule is refused too.
The one architectural exception: a projection that declares `heads` is split over "model"
only when it divides them, so a device always holds whole heads; otherwise it is
replicated over "model" (as Megatron replicates KV heads). Small per-channel parameters
(norm scales, A_log, dt_bias, the conv1d taps, the shared-expert gate) declare replication.
Guidance follows its site's declaration (`sites.Site.model_dim`).

Meshes use Auto axes, so XLA (GSPMD) inserts the collectives: the FSDP all-gathers of the
weights and the reduce-scatters of their gradients, the expert all-to-alls and the
model-parallel reductions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from trace_jax import fp4
from trace_jax.model import parameters
from trace_jax.model.scan import STACKED, StackLayout
from trace_jax.model.sites import ByLayer, site_spec

MESH_AXES = parameters.MESH_AXES


def make_mesh(data: int = 1, expert: int = 1, model: int = 1, devices=None) -> Mesh:
  """A (data, expert, model) mesh with Auto axes over the first data*expert*model devices
  (of every process: `jax.devices()` is global under `jax.distributed`)."""
  devices = jax.devices() if devices is None else devices
  need = data * expert * model
  if need > len(devices) or min(data, expert, model) < 1:
    raise ValueError(
      f"mesh data={data} x expert={expert} x model={model} needs {need} devices; "
      f"{len(devices)} available"
    )
  grid = np.asarray(devices[:need]).reshape(data, expert, model)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _path_str(path) -> str:
  return "/".join(str(p) for p in path)


def _axis_size(mesh, axis) -> int:
  return 1 if axis is None else int(mesh.shape[axis])


def data_shards(mesh: Mesh | None) -> int:
  """How many blocks of sequences the batch is split into over "data" (1 without a mesh):
  the `CallOptions.moe_blocks` of the calls that run on `mesh`."""
  return 1 if mesh is None else _axis_size(mesh, "data")


def _checked(spec: tuple, shape, mesh, what: str) -> P:
  """`spec` padded to `shape`'s rank; a ValueError if an axis does not divide its dim.
  Size-1 dims (broadcast scales) are never split."""
  axes = list(spec) + [None] * (len(shape) - len(spec))
  out = []
  for dim, (size, axis) in enumerate(zip(shape, axes)):
    if axis is None or size == 1:
      out.append(None)
      continue
    n = _axis_size(mesh, axis)
    if size % n:
      raise ValueError(
        f"{what}: dimension {dim} of shape {tuple(shape)} has size {size}, which "
        f"mesh axis {axis!r} of size {n} does not divide (mesh "
        f"{dict(mesh.shape)}); pick a mesh whose {axis!r} size divides {size}"
      )
    out.append(axis)
  return P(*out)


def param_rule(variable, mesh: Mesh | None = None, *, what: str = "parameter") -> tuple:
  """The rule (mesh axis per dimension) a parameter (an `nnx.Variable`) declares.

  With `mesh`, a projection that declares `heads` is replicated over "model" where "model"
  does not divide them (a device holds whole heads or all of them).

  Raises:
    ValueError: the variable declares no sharding (naming it as `what`).
  """
  rule = parameters.sharding_of(variable)
  if rule is None:
    raise ValueError(
      f"{what} declares no sharding; give it one where it is made "
      f"(`parameters.param(sharding=...)`: a mesh axis or None per dimension)"
    )
  heads = parameters.heads_of(variable)
  if heads is not None and mesh is not None and heads % _axis_size(mesh, "model"):
    rule = _without(tuple(rule), "model")
  return tuple(rule)


def param_spec(variable, mesh: Mesh | None = None, *, what: str = "parameter") -> P:
  """The PartitionSpec of a master parameter (checked against `mesh` if given)."""
  rule = param_rule(variable, mesh, what=what)
  if mesh is None:
    return P(*rule)
  return _checked(rule, variable.get_value().shape, mesh, what)


def _without(rule: tuple, axis: str) -> tuple:
  return tuple(None if a == axis else a for a in rule)


def param_shardings(model: nnx.Module, mesh: Mesh):
  """An nnx.State of NamedShardings matching the model's parameters (master weights)."""
  out = []
  for path, variable in nnx.to_flat_state(nnx.state(model)):
    spec = param_spec(variable, mesh, what=f"parameter {_path_str(path)}")
    out.append((path, variable.replace(NamedSharding(mesh, spec))))
  return nnx.from_flat_state(out)


def place(tree, shardings):
  """`jax.device_put` of `tree` onto `shardings`, also multi-host: an array this process
  holds whole (the same value on every process, e.g. a freshly initialised model) goes to
  a sharding spanning processes slice by slice, each process transferring its own."""

  def put(x, sharding):
    if isinstance(x, jax.Array) and x.is_fully_addressable and not sharding.is_fully_addressable:
      host = np.asarray(x)
      return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.device_put(x, sharding)

  return jax.tree.map(put, tree, shardings)


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
  """Place the model's parameters on `mesh` by their declared rules (in place; returns it)."""
  state = nnx.state(model)
  nnx.update(model, place(state, param_shardings(model, mesh)))
  return model


def _param_rules_by_path(model: nnx.Module, mesh: Mesh) -> dict[tuple, tuple[tuple, tuple]]:
  """{path: (shape, rule)} of every parameter, and of every by-layer stack of them
  (`scan.StackLayout`, as an optimizer over layer stacks holds its moments): the stack's
  path under `scan.STACKED`, its layers' leading axis unsplit."""
  params = nnx.state(model, nnx.Param)
  rules = {
    tuple(str(p) for p in path): (
      tuple(v.get_value().shape),
      param_rule(v, mesh, what=f"parameter {_path_str(path)}"),
    )
    for path, v in nnx.to_flat_state(params)
  }
  for key, paths in StackLayout.of(params).stacks.items():
    shape, rule = rules[tuple(str(p) for p in paths[0])]
    rules[(STACKED,) + tuple(str(k) for k in key)] = ((len(paths),) + shape, (None,) + rule)
  return rules


def optimizer_shardings(opt: nnx.Optimizer, model: nnx.Module, mesh: Mesh):
  """Shardings of an optimizer's state: a moment (Adam's mu, nu, ...) of a parameter takes
  that parameter's sharding (matched by the parameter path its path ends with, and its
  shape); counters and other scalars are replicated."""
  rules = _param_rules_by_path(model, mesh)
  out = []
  for path, variable in nnx.to_flat_state(nnx.state(opt)):
    value = variable.get_value()
    names = tuple(str(p) for p in path)
    spec = P()
    for start in range(len(names)):
      found = rules.get(names[start:])
      if found is not None and found[0] == tuple(value.shape):
        spec = _checked(found[1], value.shape, mesh, f"optimizer state {_path_str(path)}")
        break
    out.append((path, variable.replace(NamedSharding(mesh, spec))))
  return nnx.from_flat_state(out)


def shard_optimizer(opt: nnx.Optimizer, model: nnx.Module, mesh: Mesh) -> nnx.Optimizer:
  """Place an optimizer's state like the parameters it tracks (in place; returns it)."""
  state = nnx.state(opt)
  nnx.update(opt, place(state, optimizer_shardings(opt, model, mesh)))
  return opt


def rollout_param_shardings(params: nnx.State, mesh: Mesh):
  """Shardings of the rollout's parameters (`quantize_params` output: packed `fp4.QArray`s
  and high-precision arrays): the master rule without "data". A packed weight's codes and
  block scales split like the weight (the quantized axis shrinks by 2 and by the block
  size: its shards hold whole blocks, or the ValueError says which does not divide); its
  global scale splits over experts only."""
  out = []
  for path, variable in nnx.to_flat_state(params):
    value = variable.get_value()
    what = f"rollout parameter {_path_str(path)}"
    rule = _without(param_rule(variable, mesh, what=what), "data")
    if isinstance(value, fp4.QArray):
      sharding = jax.tree.map(
        lambda leaf: NamedSharding(mesh, _checked(rule, leaf.shape, mesh, what)), value
      )
    else:
      sharding = NamedSharding(mesh, _checked(rule, value.shape, mesh, what))
    out.append((path, variable.replace(sharding)))
  return nnx.from_flat_state(out)


def shard_rollout_params(params: nnx.State, mesh: Mesh) -> nnx.State:
  """The rollout's parameters placed by `rollout_param_shardings`."""
  return place(params, rollout_param_shardings(params, mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2, axis: int = 0) -> NamedSharding:
  """Shard the batch axis (`axis`, leading by default) over "data"."""
  spec = [None] * ndim
  spec[axis] = "data"
  return NamedSharding(mesh, P(*spec))


def cache_specs(cache, mesh: Mesh):
  """PartitionSpecs of a `KVCache` (or its eval_shape), whose fields stack their layers
  along a leading axis (replicated): K/V [N, B, L, Hkv, Dh] (packed or not) batch over
  "data" and KV heads over "model" where it divides them; the Gated DeltaNet recurrent
  state [N, B, Hv, Dk, Dv] value heads over "model" likewise; conv state and the valid mask
  batch over "data"; the write index replicated."""
  model = _axis_size(mesh, "model")

  def kv(leaf):
    heads = "model" if leaf.shape[3] % model == 0 else None
    return _checked((None, "data", None, heads), leaf.shape, mesh, "KV cache")

  def recurrent(leaf):
    heads = "model" if leaf.shape[2] % model == 0 else None
    return _checked((None, "data", heads), leaf.shape, mesh, "recurrent state")

  batch = lambda leaf: _checked(("data",), leaf.shape, mesh, "cache")  # noqa: E731
  stacked = lambda leaf: _checked((None, "data"), leaf.shape, mesh, "cache")  # noqa: E731
  return dataclasses.replace(
    cache,
    k=jax.tree.map(kv, cache.k),
    v=jax.tree.map(kv, cache.v),
    valid=batch(cache.valid),
    index=P(),
    conv=jax.tree.map(stacked, cache.conv),
    recurrent=jax.tree.map(recurrent, cache.recurrent),
  )


def constrain_cache(cache, mesh: Mesh | None):
  """Inside jit: pin a freshly made cache to `cache_specs` (no-op without a mesh)."""
  if mesh is None:
    return cache
  specs = cache_specs(cache, mesh)
  return jax.tree.map(
    lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), cache, specs
  )


def constrain_batch(tree: Any, mesh: Mesh | None, axis: int = 0):
  """Inside jit: pin every array of `tree` to batch-over-"data" along `axis` (no-op
  without a mesh), e.g. guidance buffers [B, S, ...] or routing [L, B, S, k] (axis 1)."""
  if mesh is None or tree is None:
    return tree
  return jax.tree.map(
    lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim, axis)), tree
  )


def guidance_site_specs(sites: dict, mesh: Mesh) -> dict:
  """PartitionSpecs of guidance site records {(layer, site): CompactGuidance or QArray}
  (arrays or their eval_shape), [B, S, ...]: the batch over "data", and over "model" the
  dimension the site declares (`Site.model_dim`: K/V by KV head, the inputs of o_proj /
  out_proj and of every down projection along the width) where "model" divides it (the
  layout the activation has, so capture moves no bytes between devices); a rule, not XLA's
  choice, so the memory planner predicts the bytes exactly."""
  model = _axis_size(mesh, "model")

  def spec(site: str, leaf) -> P:
    axes = ["data"] + [None] * (len(leaf.shape) - 1)
    dim = site_spec(site).model_dim
    if dim is not None and model > 1:
      dim %= len(leaf.shape)
      if dim > 0 and leaf.shape[dim] > 1 and leaf.shape[dim] % model == 0:
        axes[dim] = "model"
    return _checked(tuple(axes), leaf.shape, mesh, f"guidance site {site}")

  return {
    key: jax.tree.map(functools.partial(spec, key[1]), record) for key, record in sites.items()
  }


def guidance_specs(guidance, mesh: Mesh):
  """PartitionSpecs of a `Guidance` (or its eval_shape): sites by `guidance_site_specs`,
  routing [L, B, S, k] batch over "data"."""
  routing = None
  if guidance.routing is not None:
    routing = _checked((None, "data"), guidance.routing.shape, mesh, "guidance routing")
  return dataclasses.replace(
    guidance, sites=guidance_site_specs(guidance.sites, mesh), routing=routing
  )


def by_layer_site_specs(records: ByLayer, mesh: Mesh) -> tuple:
  """PartitionSpecs of a `ByLayer`'s stacks of site records, one tree per stack: each
  layer's `guidance_site_specs`, the stack's leading layer axis unsplit."""
  out = []
  for stack, keys in zip(records.stacks, records.keys_by_stack):
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stack)
    specs = guidance_site_specs({keys[0]: one}, mesh)[keys[0]]
    out.append(jax.tree.map(lambda spec: P(None, *spec), specs))
  return tuple(out)


def constrain_guidance_sites(sites, mesh: Mesh | None):
  """Inside jit: pin guidance site buffers ({(layer, site): record}, or a `ByLayer` of
  them) to `guidance_site_specs` (no-op without a mesh)."""
  if mesh is None or not sites:
    return sites
  pin = lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))  # noqa: E731
  if isinstance(sites, ByLayer):
    stacks = jax.tree.map(pin, sites.stacks, by_layer_site_specs(sites, mesh))
    return sites.replace(stacks=stacks)
  return jax.tree.map(pin, sites, guidance_site_specs(sites, mesh))


def device_bytes(tree) -> int:
  """Bytes of `tree`'s arrays held on one device (the largest, over devices): what the
  shardings really put there, read from `addressable_shards`."""
  per_device: dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)
