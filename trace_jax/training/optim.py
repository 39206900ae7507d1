"""Optimizer updates over a model's parameters stacked by layer.

An elementwise optimizer (a clip by global norm, Adam) applied leaf by leaf to a model of L
alike layers puts L copies of its update into the compiled program, one per layer's
parameter, and compile time grows with depth. `by_layer_stacks(inner)` runs `inner` on the
parameters stacked by layer (`scan.StackLayout`: one array per parameter of a layer, its
layers along a leading axis) and keeps `inner`'s state (Adam's moments) in that form;
`apply_update` also adds the updates to the parameters in their stacks. Per element the
arithmetic is the leaf-by-leaf one; the global norm sums the same squares grouped by stack,
so it (and a clipped update) can differ from optax's per-leaf sum in the last bit.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax
from flax import nnx

from trace_jax.model.scan import StackLayout, layer_views


class LayerStacked(NamedTuple):
  """An optax transformation (init, update) running `inner` over its tree's layer stacks."""

  init: optax.TransformInitFn
  update: optax.TransformUpdateFn
  inner: optax.GradientTransformation


def by_layer_stacks(inner: optax.GradientTransformation) -> LayerStacked:
  """`inner` over the parameters stacked by layer, its state (moments) stacked too."""

  def init(params):
    return inner.init(StackLayout.of(params).stack(params))

  def update(updates, state, params=None):
    layout = StackLayout.of(updates)
    stacked_params = None if params is None else layout.stack(params)
    out, state = inner.update(layout.stack(updates), state, stacked_params)
    return layout.unstack(out, updates), state

  return LayerStacked(init, update, inner)


def value_and_grad_by_layer(fn, model: nnx.Module, wrt=nnx.Param):
  """`nnx.value_and_grad(fn, has_aux=True)(model)` with the gradient made in the parameters'
  layer stacks: returns ((value, aux), (layout, stacked parameters, stacked gradients)),
  for `apply_stacked_update`.

  `fn` runs on the model rebuilt from views of the stacks (`StackLayout.views`), so a
  scanned run of layers reads its parameters as one slice of each stack
  (`scan.stack_layers`) and its backward adds into the stack's gradient. Differentiating
  the per-layer parameters instead puts a slice per layer in the backward (the scan's
  stacking transposed) and a stack per layer before the optimizer. Per element the
  gradient is the same sum."""
  graphdef, params, rest = nnx.split(model, wrt, ...)
  params = nnx.as_pure(params)
  layout = StackLayout.of(params)
  stacked = layout.stack(params)

  def of_stacked(stacked):
    with layer_views():
      return fn(nnx.merge(graphdef, layout.views(stacked, params), rest))

  out, grads = jax.value_and_grad(of_stacked, has_aux=True)(stacked)
  return out, (layout, stacked, grads)


def apply_stacked_update(opt: nnx.Optimizer, model: nnx.Module, layout, params, grads):
  """The update of `apply_update` from parameters and gradients already in their layer
  stacks (`value_and_grad_by_layer`), with a `LayerStacked` transformation; returns the
  gradients' global norm."""
  if not isinstance(opt.tx, LayerStacked):
    raise ValueError(
      f"apply_stacked_update needs an optimizer over layer stacks (by_layer_stacks); "
      f"got {type(opt.tx).__name__}"
    )
  updates, state = opt.tx.inner.update(grads, nnx.as_pure(opt.opt_state), params)
  like = nnx.as_pure(nnx.state(model, opt.wrt))
  nnx.update(model, layout.unstack(optax.apply_updates(params, updates), like))
  nnx.update(opt.opt_state, nnx.state(state))
  opt.step[...] += 1
  return optax.global_norm(grads)


def apply_update(opt: nnx.Optimizer, model: nnx.Module, grads) -> jax.Array:
  """`opt.update(model, grads)`; returns the gradients' global norm. With a `LayerStacked`
  transformation the updates are also added to the parameters in their stacks (one add
  per stack, not per layer) and the norm is summed by stack."""
  if not isinstance(opt.tx, LayerStacked):
    opt.update(model, grads)
    return optax.global_norm(grads)
  params = nnx.as_pure(nnx.state(model, opt.wrt))
  grads = nnx.as_pure(nnx.state(grads, opt.wrt))
  layout = StackLayout.of(grads)
  return apply_stacked_update(opt, model, layout, layout.stack(params), layout.stack(grads))
