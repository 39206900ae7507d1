"""QuantSpec: the one static argument of the quantize cores is a sound jit key."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import pytest

from trace_jax import fp4
from trace_jax.fp4.spec import QuantSpec, resolve

# The module, not the function `fp4.quantize` that the package exports under its name.
quantize_mod = importlib.import_module("trace_jax.fp4.quantize")


def test_equal_arguments_share_one_trace(monkeypatch):
  """Spellings of the same choices (axis -1 or 1, "row" or the axis tuple) and different
  arrays (keys, static scales) trace each core once; a different choice traces again."""
  traced = []
  real = quantize_mod._quantize_last

  def counting(spec, *args):
    traced.append(spec)
    return real(spec, *args)

  monkeypatch.setattr(quantize_mod, "_quantize_last", counting)
  x = jax.random.normal(jax.random.key(0), (7, 80)) * 3  # a shape no other test uses
  row = QuantSpec(fmt="nvfp4", axis=1, group_axes=(0,))
  for axis, group in ((-1, "row"), (1, "row"), (1, 0), (-1, [-2]), (1, (0, 0))):
    fp4.quantize(x, axis=axis, global_group=group)
    fp4.fake_quant(x, axis=axis, global_group=group)
    fp4.fake_quant_record(x, form="compact", axis=axis, global_group=group)
  assert traced == [row, row, dataclasses.replace(row, record="compact")]

  del traced[:]
  for seed in (1, 2):
    fp4.fake_quant(x, rounding="stochastic", key=jax.random.key(seed), global_group="row")
    fp4.fake_quant(x, global_group="row", global_scale=jnp.full((7, 1), 10.0 * seed))
  fp4.fake_quant(x, global_group="row", scale_rule="4over6")
  stochastic = dataclasses.replace(row, rounding="stochastic")
  assert traced == [stochastic, row, dataclasses.replace(row, scale_rule="4over6")]


def test_resolved_specs_compare_and_hash_equal_and_are_frozen():
  x = jax.random.normal(jax.random.key(1), (2, 3, 32))
  first, _, _ = resolve(x, "nvfp4", -1, (1, 0), "nearest", None, None)
  second, _, _ = resolve(x, "nvfp4", 2, [0, -2, 0], "nearest", None, None)
  assert first == second and hash(first) == hash(second)
  assert first == QuantSpec(fmt="nvfp4", axis=2, group_axes=[1, 0, 1])  # a list, in any order
  assert first != dataclasses.replace(first, group_axes=(0,))
  with pytest.raises(dataclasses.FrozenInstanceError):
    first.axis = 0


@pytest.mark.parametrize(
  "fields, match",
  [
    (dict(fmt="int4"), "fmt='int4'"),
    (dict(rounding="up"), "rounding='up'"),
    (dict(scale_rule="5over6"), "scale_rule='5over6'"),
    (dict(fmt="mxfp4", scale_rule="4over6"), "fmt='mxfp4'"),
    (dict(rounding="stochastic", scale_rule="4over6"), "rounding='stochastic'"),
    (dict(record="codes"), "form='codes'"),
    (dict(axis=-1), "axis=-1"),
    (dict(group_axes=(0, 1)), "axis=1"),
  ],
)
def test_spec_rejects_a_bad_field_by_name(fields, match):
  with pytest.raises(ValueError, match=match):
    QuantSpec(**{"fmt": "nvfp4", "axis": 1, **fields})
