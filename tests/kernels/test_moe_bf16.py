"""kernels.moe_bf16: the four bf16 MoE baselines against the row-by-row reference, and
their timed calls doing no weight re-layout."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import moe_bf16


def _inputs(seed, n=6, top_k=2, d=32, f=32, experts=4):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
  routed = jax.random.randint(keys[1], (n, top_k), 0, experts)
  ws = [
    (jax.random.normal(k, s, jnp.float32) * 0.2).astype(jnp.bfloat16)
    for k, s in zip(keys[2:], ((experts, d, f), (experts, d, f), (experts, f, d)))
  ]
  return x, routed, ws


def _numpy_reference(x, experts, w_gate, w_up, w_down):
  """Row by row in float64 NumPy, rounding gate, up and h to bf16 as the model does."""
  as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
  bf16 = lambda a: as64(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16))  # noqa: E731
  x, wg, wu, wd = map(as64, (x, w_gate, w_up, w_down))
  out = np.zeros((*experts.shape, x.shape[1]))
  for t, row in enumerate(np.asarray(experts)):
    for slot, e in enumerate(row):
      gate, up = bf16(x[t] @ wg[e]), bf16(x[t] @ wu[e])
      h = bf16(gate / (1 + np.exp(-gate)) * up)
      out[t, slot] = h @ wd[e]
  return out


@pytest.mark.parametrize("kind", moe_bf16.CANDIDATES)
def test_each_kind_matches_the_row_by_row_definition(kind):
  x, experts, ws = _inputs(seed=hash(kind) % 1000)
  y = jax.jit(lambda x, e, a, b: moe_bf16.apply(kind, x, e, a, b))(
    x, experts, *moe_bf16.prepare(kind, *ws)
  )
  assert y.shape == (*experts.shape, x.shape[1]) and y.dtype == jnp.bfloat16
  want = _numpy_reference(x, experts, *ws)
  # bf16 output; the kinds sum in different orders, so h may round differently by an ulp
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=3e-2, atol=3e-2)
  reference = np.asarray(moe_bf16.reference(x, experts, *ws), np.float64)
  np.testing.assert_allclose(reference, want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("kind", moe_bf16.CANDIDATES)
def test_the_timed_call_does_no_weight_relayout(kind):
  """`apply` on prepared weights: no operation in it outputs an array as large as the
  gate|up weights (a fuse, concatenate or transpose of the weights would)."""
  x, experts, ws = _inputs(seed=7, n=2, top_k=1, d=64, f=32, experts=8)
  prepared = moe_bf16.prepare(kind, *ws)
  jaxpr = jax.make_jaxpr(lambda *a: moe_bf16.apply(kind, *a))(x, experts, *prepared)
  weight_size = prepared[0].size

  def sizes(jaxpr):
    for eqn in jaxpr.eqns:
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from sizes(sub)
      yield from ((eqn.primitive.name, v.aval.size) for v in eqn.outvars)

  big = [(name, size) for name, size in sizes(jaxpr.jaxpr) if size >= weight_size // 2]
  assert not big, big


def test_an_unknown_kind_is_refused():
  with pytest.raises(ValueError, match="kind='sorted' is not allowed"):
    moe_bf16.prepare("sorted", *_inputs(0)[2])
