"""Which layers of a forward run under one `jax.lax.scan` (ModelConfig.scan_layers).

A scan compiles its body once however many layers it covers, so the program holds one copy
of a layer (or of a repeating group of layers) instead of one per layer. Layers are alike
when everything that shapes their program is the same: their kind (attention or Gated
DeltaNet, MoE or dense feed-forward), whether this forward guides or records them, and the
shapes of their guidance. `layer_groups` cuts the stack into runs of a repeating pattern of
alike layers (a period of 1 for a plain MoE stack, the 3 + 1 pattern of Qwen3.5's hybrid
layers) and leaves every layer that starts no repeat, such as dense-first layers, unrolled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

MAX_PERIOD = 8  # the longest repeating pattern looked for


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """Layers [start, start + period * repeats): `repeats` copies of a `period`-layer
  pattern. repeats == 1 (and period == 1): one layer, unrolled."""

  start: int
  period: int
  repeats: int

  @property
  def scanned(self) -> bool:
    return self.repeats > 1

  def layers(self, template: int) -> tuple[int, ...]:
    """The layers the pattern's `template`-th layer stands for, one per repeat."""
    return tuple(self.start + r * self.period + template for r in range(self.repeats))


def layer_groups(signatures: Sequence[Hashable], max_period: int = MAX_PERIOD) -> list[LayerGroup]:
  """Cut layers with these per-layer signatures into scanned runs and single layers.

  From each layer on, the pattern (of at most `max_period` layers) whose repeats cover the
  most layers wins (the shorter pattern on a tie); a layer no pattern of two or more
  repeats starts at stays a single, unrolled layer.
  """
  sigs = list(signatures)
  n, i, out = len(sigs), 0, []
  while i < n:
    best = LayerGroup(i, 1, 1)
    for period in range(1, max_period + 1):
      pattern = sigs[i : i + period]
      if len(pattern) < period:
        break
      repeats = 1
      while sigs[i + repeats * period : i + (repeats + 1) * period] == pattern:
        repeats += 1
      if repeats > 1 and period * repeats > best.period * best.repeats:
        best = LayerGroup(i, period, repeats)
    out.append(best)
    i += best.period * best.repeats
  return out


def in_key_order(parts: Sequence[tuple[tuple, Any]]) -> tuple[tuple, Any]:
  """Stacked trees joined in key order: `parts` is [(keys, tree stacked along a leading
  axis, one entry per key)]; returns (the keys sorted, one tree of every entry in that
  order). A scan's outputs (a run of alike layers) join the unrolled layers' this way with
  one concatenate (and, where the runs interleave, one gather) per leaf, not a slice per
  layer and a stack."""
  keys = [key for part_keys, _ in parts for key in part_keys]
  trees = [tree for _, tree in parts]
  whole = trees[0] if len(trees) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *trees)
  order = sorted(range(len(keys)), key=keys.__getitem__)
  if order != list(range(len(keys))):
    index = np.asarray(order)
    whole = jax.tree.map(lambda a: a[index], whole)
  return tuple(keys[i] for i in order), whole


def _layer_position(path: tuple) -> int | None:
  """Where in `path` the layer index sits (the integer key right under "blocks"), or None."""
  for i, key in enumerate(path[:-1]):
    if key == "blocks" and isinstance(path[i + 1], int):
      return i + 1
  return None


def layer_stack_key(path: tuple) -> tuple | None:
  """A leaf's path with its layer index taken out (None for a leaf of no layer): the leaves
  of one key (and shape and dtype) in different layers are one parameter of each layer,
  which a by-layer stack holds along a leading axis, layers in order."""
  at = _layer_position(path)
  return None if at is None else path[:at] + path[at + 1 :]


STACKED = "layers"  # a stacked tree's subtree of layer stacks, by stack key
UNSTACKED = "rest"  # and of every other leaf, at its own path


@dataclasses.dataclass(frozen=True)
class StackLayout:
  """How a tree's leaves map to its by-layer stacked form {STACKED: ..., UNSTACKED: ...}:
  per stack key, the paths of its leaves (layers in order); the paths left as they are."""

  stacks: dict[tuple, tuple[tuple, ...]]
  rest: tuple[tuple, ...]

  @classmethod
  def of(cls, tree) -> "StackLayout":
    """A stack per (stack key, shape, dtype) that two or more layers share; a leaf of no
    layer, or of a parameter no other layer has alike, left at its path."""
    flat = flat_paths(tree)
    groups: dict[tuple, list[tuple]] = {}
    for path, leaf in flat.items():
      key = layer_stack_key(path)
      if key is not None:
        groups.setdefault((key, tuple(leaf.shape), str(leaf.dtype)), []).append(path)
    stacks: dict[tuple, tuple[tuple, ...]] = {}
    for (key, _, _), paths in groups.items():
      if len(paths) < 2:
        continue
      while key in stacks:  # the same parameter, shaped otherwise in other layers
        key = key + ("alt",)
      stacks[key] = tuple(sorted(paths, key=lambda p: p[_layer_position(p)]))
    taken = {p for paths in stacks.values() for p in paths}
    return cls(stacks, tuple(p for p in flat if p not in taken))

  def stack(self, tree) -> dict:
    """`tree`'s leaves in stacked form: {STACKED: {key...: [n, ...]}, UNSTACKED: {path...}}."""
    flat = flat_paths(tree)
    stacked = {key: jnp.stack([flat[p] for p in paths]) for key, paths in self.stacks.items()}
    return {
      STACKED: traverse_util.unflatten_dict(stacked),
      UNSTACKED: traverse_util.unflatten_dict({p: flat[p] for p in self.rest}),
    }

  def unstack(self, stacked: dict, like):
    """The inverse of `stack`: a tree of `like`'s structure (and type)."""
    flat = flat_paths(stacked)
    out = {p[1:]: leaf for p, leaf in flat.items() if p[0] == UNSTACKED}
    for key, paths in self.stacks.items():
      whole = flat[(STACKED,) + key]
      out.update({path: whole[i] for i, path in enumerate(paths)})
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [out[_keys(p)] for p, _ in leaves])

  def views(self, stacked: dict, like):
    """`unstack`, its slices registered as views of their stacks while a `layer_views()`
    context is open: `stack_layers` then takes a run of layers from the stack as one
    strided slice. Differentiated through, a parameter's gradient is then made in its
    stack (a pad per run of layers), not as one slice per layer stacked again."""
    tree = self.unstack(stacked, like)
    registry = _view_registry()
    if registry is not None:
      flat, views = flat_paths(stacked), flat_paths(tree)
      for key, paths in self.stacks.items():
        for i, path in enumerate(paths):
          registry[id(views[path])] = (views[path], flat[(STACKED,) + key], i)
    return tree


_VIEWS = threading.local()


def _view_registry() -> dict | None:
  return getattr(_VIEWS, "registry", None)


@contextlib.contextmanager
def layer_views():
  """While open, `StackLayout.views` registers its slices (by identity) for `stack_layers`."""
  outer = _view_registry()
  _VIEWS.registry = {}
  try:
    yield
  finally:
    _VIEWS.registry = outer


def stack_layers(trees):
  """Trees of equal structure stacked leaf by leaf along a new leading axis; a leaf whose
  entries are registered views (`StackLayout.views`) of one stack, at evenly spaced
  layers, is that stack's strided slice (the same values)."""
  registry = _view_registry() or {}

  def stack(*leaves):
    seen = [registry.get(id(leaf)) for leaf in leaves]
    if all(v is not None and v[0] is leaf for v, leaf in zip(seen, leaves)):
      whole, index = seen[0][1], [v[2] for v in seen]
      step = index[1] - index[0] if len(index) > 1 else 1
      spaced = step > 0 and index == list(range(index[0], index[0] + step * len(index), step))
      if spaced and all(v[1] is whole for v in seen):
        if index == list(range(whole.shape[0])):
          return whole
        stop = index[-1] + 1
        return jax.lax.slice_in_dim(whole, index[0], stop, stride=step, axis=0)
    return jnp.stack(leaves)

  return jax.tree.map(stack, *trees)


def _keys(path) -> tuple:
  """A jax key path as plain keys (dict keys, sequence indices, attribute names)."""
  return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def flat_paths(tree) -> dict[tuple, Any]:
  """{path: leaf} of a nested dict or an nnx.State (its variables' values)."""
  tree = nnx.as_pure(tree) if isinstance(tree, nnx.State) else tree
  return {_keys(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
