"""Parameters and the facts about them, declared where the module that owns them makes them.

Each parameter is an `nnx.Param` whose metadata (flax's own mechanism: keyword arguments
of the Variable, kept through `nnx.state`, `split`/`merge`, `replace` and the optimizer's
moments) says what the rest of the code needs to know about it:

  out_sharding  the mesh axis of each dimension ("data", "expert", "model" or None), flax's
                sharding annotation (`nnx.get_partition_spec` reads it); `model.sharding`
                checks it against a mesh and places the arrays. Never applied at creation
                (eager_sharding=False): the mesh is chosen later, per run.
  heads         the number of heads along the dimension split over "model": that split is
                dropped where "model" does not divide them (a device holds whole heads).
  quant_group   for a linear weight FP4 can quantize: its `WEIGHT_GROUPS` entry (a scope
                quantizes whole groups); absent for everything that stays in high precision
                (embedding, LM head, router, norms, the shared-expert gate, conv, decay).
  scale_group   (name, position): siblings of one module with the same name share one FP4
                global scale, in that order along the output axis ([q | k | v], [gate | up]),
                as fused serving kernels read them (vLLM's qkv_proj and gate_up_proj).
  input_site    the name of the activation site whose values the linear multiplies (an
                export's static input scales are that site's).

Quantization (`quant.is_quantized_weight`, `quant.scale_groups`), sharding, export and the
memory planner read these; none of them keeps a table of parameter names.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

# Groups of linear weights, by the module that owns them; a scope quantizes whole groups.
WEIGHT_GROUPS = ("attention", "experts", "shared", "mlp")
MESH_AXES = ("data", "expert", "model")


def param(
  value: jax.Array,
  *,
  sharding: Sequence[str | None],
  heads: int | None = None,
  quant_group: str | None = None,
  scale_group: tuple[str, int] | None = None,
  input_site: Any = None,
) -> nnx.Param:
  """An `nnx.Param` holding `value`, with its metadata (see the module docstring).

  Args:
    value: the initial array.
    sharding: the mesh axis (`MESH_AXES`) or None of each dimension of `value`.
    heads: heads along the dimension split over "model" (attention projections).
    quant_group: the `WEIGHT_GROUPS` entry of a linear weight FP4 can quantize.
    scale_group: (name, position) among the siblings sharing one global scale.
    input_site: the `sites.Site` (or its name) whose activation the linear multiplies.
  """
  sharding = tuple(sharding)
  if len(sharding) != value.ndim or any(a not in MESH_AXES + (None,) for a in sharding):
    raise ValueError(
      f"sharding={sharding} must name one of {MESH_AXES} or None for each of the "
      f"{value.ndim} dimensions of shape {tuple(value.shape)}"
    )
  if heads is not None and "model" not in sharding:
    raise ValueError(f"heads={heads} needs a dimension split over 'model'; sharding={sharding}")
  if quant_group is not None and quant_group not in WEIGHT_GROUPS:
    raise ValueError(f"quant_group={quant_group!r} is not allowed; use one of {WEIGHT_GROUPS}")
  if (scale_group is not None or input_site is not None) and quant_group is None:
    raise ValueError("scale_group and input_site describe a quantized linear: give quant_group")
  if quant_group is not None and input_site is None:
    raise ValueError(f"a linear weight of quant_group={quant_group!r} must name its input_site")
  metadata: dict[str, Any] = {"out_sharding": sharding}
  if heads is not None:
    metadata["heads"] = int(heads)
  if quant_group is not None:
    metadata["quant_group"] = quant_group
    metadata["input_site"] = getattr(input_site, "name", input_site)
  if scale_group is not None:
    metadata["scale_group"] = (str(scale_group[0]), int(scale_group[1]))
  return nnx.Param(value, eager_sharding=False, **metadata)


def param_key(rngs: nnx.Rngs) -> jax.Array:
  """`rngs.params()`: the same key, and the same step of the stream's count.

  flax's stream writes its count as `count[...] = count + 1`, which, for a traced count (a
  model built under `nnx.eval_shape` or a jitted init), asks the new value for its sharding;
  JAX answers a tracer's with an error message that traces the value's origin through every
  operation recorded so far, so building a model that way takes time quadratic in its number
  of parameters. `set_value` replaces the count whole, without that check (flax still
  refuses a write from another trace level)."""
  stream = rngs.params
  count = stream.count[...]
  key = jax.random.fold_in(stream.key[...], count)
  stream.count.set_value(count + 1)
  return key


def normal_param(rngs: nnx.Rngs, shape, std: float, **metadata) -> nnx.Param:
  """A matrix drawn from N(0, std^2) in float32, with its metadata (`param`'s arguments)."""
  return param(std * jax.random.normal(param_key(rngs), shape, jnp.float32), **metadata)


def _meta(variable, name: str):
  return variable.get_metadata(name, None) if isinstance(variable, nnx.Variable) else None


def sharding_of(variable) -> tuple[str | None, ...] | None:
  """The declared mesh axis of each dimension, or None if the variable declares none."""
  return _meta(variable, "out_sharding")


def heads_of(variable) -> int | None:
  """Heads along the dimension split over "model", or None."""
  return _meta(variable, "heads")


def quant_group(variable) -> str | None:
  """The `WEIGHT_GROUPS` entry of a linear weight FP4 can quantize, else None."""
  return _meta(variable, "quant_group")


def scale_group(variable) -> tuple[str, int] | None:
  """(name, position) of the siblings sharing its global scale, or None (alone)."""
  return _meta(variable, "scale_group")


def input_site(variable) -> str | None:
  """The activation site whose values the linear multiplies, or None."""
  return _meta(variable, "input_site")
