"""Weight sync: the rollout's copy of the policy parameters."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import fp4
from trace_jax.kernels import layout, moe as moe_kernels
from trace_jax.model import parameters
from trace_jax.model import sharding as sharding_lib
from trace_jax.model.quant import QuantConfig, is_quantized_weight, scale_groups, weight_group
from trace_jax.model.quantizer import quantize_weight_group


def quantize_params(
  params: nnx.State, quant: QuantConfig | None, *, dtype=jnp.bfloat16
) -> nnx.State:
  """The rollout's parameters, made once per weight sync.

  With an FP4 `quant`, every linear weight in its scope (`quant.sites`) becomes a packed `fp4.QArray` (per
  matrix, per expert for stacked experts): dequantizing it gives, bit for bit, the weight
  the training path fake-quantizes from the same master weights. Siblings that declare one
  `scale_group` (q/k/v of a layer, gate/up of an expert) share one global scale, as
  fused serving kernels require, so an export writes exactly these bytes. A weight that is
  already packed (a policy loaded from an FP4 checkpoint) is kept as it is. Everything
  DESIGN.md keeps in high precision (embedding, LM head, router, norms, linear weights
  outside the scope) stays float32. Without FP4 (`quant` None or precision "bf16") the linear
  weights are cast to `dtype` and the rest stays float32 too: the bf16 arm's router and LM
  head then run exactly as the FP4 arms' do, so no arm carries a mismatch the others do not.

  Args:
    params: `nnx.state(policy)`, float32 master weights.
    quant: the rollout's QuantConfig.
    dtype: dtype of the unquantized parameters of a bf16 rollout.
  """
  fp4_rollout = quant is not None and quant.enabled
  flat = list(nnx.to_flat_state(params))
  values = {}
  if fp4_rollout and quant.weights:
    state = dict(flat)
    for group in scale_groups(flat, quant):
      packed = quantize_weight_group([state[path].get_value() for path in group], quant.fmt)
      values.update(zip(group, packed))
  out = []
  for path, variable in flat:
    value = variable.get_value()
    if isinstance(value, fp4.QArray):
      if not fp4_rollout:
        value = fp4.dequantize(value, dtype)
    elif not fp4_rollout:
      if is_quantized_weight(variable):
        value = value.astype(dtype)
    else:
      value = values.get(tuple(path), value)
    out.append((path, variable.replace(value)))
  return nnx.from_flat_state(out)


def _packed_scale_groups(flat) -> list[tuple[tuple, ...]]:
  """Paths of packed siblings (`fp4.QArray` values) that declare one `scale_group`, in their
  declared order ([q, k, v], [gate, up]); groups of two or more only."""
  groups: dict[tuple, list[tuple[int, tuple]]] = {}
  for path, variable in flat:
    shared = parameters.scale_group(variable)
    if shared is not None and isinstance(variable.get_value(), fp4.QArray):
      groups.setdefault((tuple(path[:-1]), shared[0]), []).append((shared[1], tuple(path)))
  members = [tuple(path for _, path in sorted(group)) for group in groups.values()]
  return [group for group in members if len(group) > 1]


def fuse_for_kernels(params: nnx.State) -> nnx.State:
  """`quantize_params` output with each group of packed siblings that share a global scale
  (q|k|v, gate|up: they declare one `scale_group`) fused into the one matrix the Pallas FP4
  GEMM reads (`kernels.layout`): the first sibling holds the `FusedWeight`, the others a
  `FusedPart`. Routed experts' gate|up interleave in the grouped GEMM's column tiles (its
  SwiGLU epilogue); the rest side by side. The bytes are the per-matrix weights' own, and
  `unfuse` gives those back bit for bit (the export reads `quantize_params` directly)."""
  flat = list(nnx.to_flat_state(params))
  variables = {tuple(path): variable for path, variable in flat}
  values = {}
  for group in _packed_scale_groups(flat):
    parts = [variables[path].get_value() for path in group]
    routed = weight_group(variables[group[0]]) == "experts"
    tile = moe_kernels.swiglu_tile(parts[0].packed.shape[-1]) if routed else None
    values[group[0]] = layout.fuse(parts, tile=tile)
    values.update({path: layout.FusedPart(i) for i, path in enumerate(group) if i})
  return _replaced(flat, values)


def unfuse(params: nnx.State) -> nnx.State:
  """The inverse of `fuse_for_kernels`: every sibling's own packed `QArray` again."""
  flat = list(nnx.to_flat_state(params))
  groups: dict[tuple, list[tuple[int, tuple]]] = {}
  for path, variable in flat:
    shared = parameters.scale_group(variable)
    if shared is not None:
      groups.setdefault((tuple(path[:-1]), shared[0]), []).append((shared[1], tuple(path)))
  variables = {tuple(path): variable for path, variable in flat}
  values = {}
  for group in groups.values():
    paths = [path for _, path in sorted(group)]
    fused = variables[paths[0]].get_value()
    if isinstance(fused, layout.FusedWeight):
      values.update(zip(paths, fused.parts()))
  return _replaced(flat, values)


def _replaced(flat, values: dict) -> nnx.State:
  return nnx.from_flat_state(
    [
      (path, variable.replace(values.get(tuple(path), variable.get_value())))
      for path, variable in flat
    ]
  )


fuse_for_kernels_jit = jax.jit(fuse_for_kernels)


def params_nbytes(params: nnx.State) -> int:
  """Bytes of a parameter state (packed weights count their packed bytes)."""
  return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params)))


quantize_params_jit = jax.jit(quantize_params, static_argnums=1, static_argnames="dtype")


@functools.lru_cache(maxsize=32)
def _abstract_rollout(in_tree, avals: tuple, quant: QuantConfig | None, dtype) -> nnx.State:
  """`jax.eval_shape` of `quantize_params` on parameters of structure `in_tree` and `avals`."""
  return jax.eval_shape(
    lambda leaves: quantize_params(jax.tree.unflatten(in_tree, leaves), quant, dtype=dtype),
    list(avals),
  )


@functools.lru_cache(maxsize=32)
def _sync_program(in_tree, quant: QuantConfig | None, dtype, out_shardings: tuple):
  """One jitted `quantize_params` over flat leaves whose flat outputs land on `out_shardings`."""

  def run(leaves):
    return jax.tree.leaves(quantize_params(jax.tree.unflatten(in_tree, leaves), quant, dtype=dtype))

  return jax.jit(run, out_shardings=list(out_shardings))


def _device_order(sharding) -> tuple:
  if isinstance(sharding, jax.sharding.NamedSharding):
    return tuple(sharding.mesh.devices.flat)
  return tuple(sorted(sharding.device_set, key=lambda d: (d.process_index, d.id)))


def sync_params(
  params: nnx.State, quant: QuantConfig | None, mesh, *, dtype=jnp.bfloat16
) -> nnx.State:
  """Weight sync onto `mesh`: `quantize_params` of the master weights, every output laid out
  by `sharding.rollout_param_shardings` on `mesh`.

  Where the master weights live on `mesh`'s devices (in its order), this is one jitted
  program whose outputs are born in their rollout shardings: each device makes its own
  slices, and no array passes through a host, on one process or many. Master weights on
  other devices (a separate rollout device group) are packed where they live and then
  moved device to device (`jax.device_put`). The values are `quantize_params`' bit for bit
  (packing is elementwise per block and per global-scale group; only maxima reduce).

  Args:
    params: `nnx.state(policy)`, float32 master weights (sharded or not).
    quant: the rollout's QuantConfig.
    mesh: the rollout engine's mesh.
    dtype: dtype of the unquantized parameters of a bf16 rollout.
  """
  dtype = jnp.dtype(dtype)
  leaves, in_tree = jax.tree.flatten(params)
  avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
  abstract = _abstract_rollout(in_tree, avals, quant, dtype)
  targets = tuple(jax.tree.leaves(sharding_lib.rollout_param_shardings(abstract, mesh)))
  order = tuple(mesh.devices.flat)
  same_devices = all(
    isinstance(x, jax.Array) and _device_order(x.sharding) == order for x in leaves
  )
  if same_devices:
    out = _sync_program(in_tree, quant, dtype, targets)(leaves)
  else:
    packed = jax.tree.leaves(quantize_params_jit(params, quant, dtype=dtype))
    out = [jax.device_put(x, s) for x, s in zip(packed, targets)]
  return jax.tree.unflatten(jax.tree.structure(abstract), out)
