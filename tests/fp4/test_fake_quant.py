"""fake_quant: straight-through gradients, and guidance/keys as ordinary pytree arguments."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import fp4


class FakeQuantTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_gradient_is_identity_and_not_rounded(self):
    x = jax.random.normal(jax.random.key(0), (4, 64))
    w = jax.random.normal(jax.random.key(1), (4, 64))  # arbitrary cotangent, not FP4-representable
    for fmt in ("nvfp4", "mxfp4"):
      loss = self.variant(lambda x: jnp.sum(w * fp4.fake_quant(x, fmt, global_group="row")))
      chex.assert_trees_all_equal(jax.grad(loss)(x), w)

  @chex.variants(with_jit=True, without_jit=True)
  def test_values_equal_dequantize_of_quantize(self):
    x = jax.random.normal(jax.random.key(2), (8, 32)) * 3
    got = self.variant(lambda x: fp4.fake_quant(x, global_group="row"))(x)
    chex.assert_trees_all_equal(got, fp4.dequantize(fp4.quantize(x, global_group="row")))

  @chex.variants(with_jit=True, without_jit=True)
  def test_guided_gradient_and_values(self):
    x = jax.random.normal(jax.random.key(3), (4, 32))
    q_ref = fp4.quantize(x, global_group="row")
    w = jax.random.normal(jax.random.key(4), (4, 32))
    for guidance in (q_ref, fp4.compact_guidance(q_ref)):
      f = self.variant(lambda x, g: jnp.sum(w * fp4.fake_quant(x, rounding="guided", guidance=g)))
      chex.assert_trees_all_equal(jax.grad(f)(x, guidance), w)
      value = self.variant(lambda x, g: fp4.fake_quant(x, rounding="guided", guidance=g))(
        x, guidance
      )
      chex.assert_trees_all_equal(value, fp4.dequantize(q_ref))

  @chex.variants(with_jit=True, without_jit=True)
  def test_stochastic_with_key_argument(self):
    x = jax.random.normal(jax.random.key(5), (2, 32))
    f = self.variant(lambda x, k: fp4.fake_quant(x, rounding="stochastic", key=k))
    chex.assert_trees_all_equal(f(x, jax.random.key(7)), f(x, jax.random.key(7)))
    chex.assert_trees_all_equal(
      jax.grad(lambda x: f(x, jax.random.key(7)).sum())(x), jnp.ones_like(x)
    )


def test_bf16_keeps_dtype_and_gradient_dtype():
  x = jax.random.normal(jax.random.key(6), (4, 32)).astype(jnp.bfloat16)
  y = fp4.fake_quant(x, global_group="row")
  assert y.dtype == jnp.bfloat16
  g = jax.grad(lambda x: jnp.sum(fp4.fake_quant(x).astype(jnp.float32) * 0.1))(x)
  assert g.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
    np.asarray(g, np.float32), np.full((4, 32), np.float32(jnp.bfloat16(0.1)))
  )


def test_vmap_over_keys_and_scan_over_guidance():
  x = jax.random.normal(jax.random.key(8), (3, 4, 32))  # [layers, tokens, features]
  q_ref = fp4.quantize(x, global_group=(0, 1))  # one global scale per (layer, token)
  guidance = fp4.compact_guidance(q_ref)

  def body(carry, inputs):
    x_l, g_l = inputs
    return carry + jnp.sum(fp4.fake_quant(x_l, rounding="guided", guidance=g_l)), None

  total, _ = jax.lax.scan(body, 0.0, (x, guidance))
  np.testing.assert_allclose(total, jnp.sum(fp4.dequantize(q_ref)), rtol=1e-6)
  grad = jax.grad(lambda x: jax.lax.scan(body, 0.0, (x, guidance))[0])(x)
  chex.assert_trees_all_equal(grad, jnp.ones_like(x))

  per_layer = jax.vmap(lambda x_l: fp4.quantize(x_l, global_group="row"))(x)
  assert per_layer.axis == -1 and per_layer.packed.shape == (3, 4, 16)
  np.testing.assert_array_equal(per_layer.packed, q_ref.packed)
  keys = jax.random.split(jax.random.key(9), 3)
  draws = jax.vmap(lambda x_l, k: fp4.fake_quant(x_l, rounding="stochastic", key=k))(x, keys)
  assert draws.shape == x.shape


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(fmt="int4"), "fmt='int4'.*allowed"),
    (dict(rounding="up"), "rounding='up'.*allowed"),
    (dict(rounding="stochastic"), "needs key"),
    (dict(global_group="block"), "global_group='block'"),
    (dict(global_group=1), "quantized axis"),
    (dict(global_group=5), "out of range"),
    (dict(axis=3), "axis=3 is out of range"),
  ],
)
def test_bad_arguments_raise_value_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    fp4.quantize(jnp.ones((4, 32)), **kwargs)
  with pytest.raises(ValueError, match=match):
    fp4.fake_quant(jnp.ones((4, 32)), **kwargs)


def test_block_multiple_and_dtype_errors():
  with pytest.raises(ValueError, match="length 24, not a multiple of 16"):
    fp4.quantize(jnp.ones((4, 24)))
  with pytest.raises(ValueError, match="multiple of 32"):
    fp4.quantize(jnp.ones((4, 48)), "mxfp4")
  with pytest.raises(ValueError, match="floating"):
    fp4.quantize(jnp.ones((4, 32), jnp.int32))


class FakeQuantRecordTest(chex.TestCase):
  """One quantization gives the values of `fake_quant` and the record of `quantize`."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_values_and_records_match_two_pass(self):
    # bf16 inputs hit exact E2M1 ties; a NaN row checks the fault stays visible.
    x = (jax.random.normal(jax.random.key(5), (3, 5, 64)) * 4).astype(jnp.bfloat16)
    x = x.at[1, 2, 7].set(jnp.nan)
    for fmt in ("nvfp4", "mxfp4"):
      q = fp4.quantize(x, fmt, global_group="row")
      want = fp4.fake_quant(x, fmt, global_group="row")
      for form, record in (("full", q), ("compact", fp4.compact_guidance(q))):
        values, got, fell_back = self.variant(
          lambda x: fp4.fake_quant_record(x, fmt, form=form, global_group="row")
        )(x)
        chex.assert_trees_all_equal(values, want)
        chex.assert_trees_all_equal(got, record)
        self.assertFalse(bool(jnp.any(fell_back)))

  @chex.variants(with_jit=True, without_jit=True)
  def test_guided_fallbacks_and_gradient(self):
    x = jax.random.normal(jax.random.key(6), (4, 32))
    rollout = fp4.quantize(
      x + 0.05 * jax.random.normal(jax.random.key(7), x.shape), global_group="row"
    )
    w = jax.random.normal(jax.random.key(8), x.shape)
    for guidance in (rollout, fp4.compact_guidance(rollout)):
      q, fb = fp4.quantize_with_fallbacks(x, rounding="guided", guidance=guidance)
      values, record, fell_back = self.variant(
        lambda x, g: fp4.fake_quant_record(x, form="full", rounding="guided", guidance=g)
      )(x, guidance)
      chex.assert_trees_all_equal(record, q)
      chex.assert_trees_all_equal(fell_back, fb)
      chex.assert_trees_all_equal(values, fp4.fake_quant(x, rounding="guided", guidance=guidance))
      grad = jax.grad(
        lambda x: jnp.sum(
          w * fp4.fake_quant_record(x, form="compact", rounding="guided", guidance=guidance)[0]
        )
      )(x)
      chex.assert_trees_all_equal(grad, w)

  def test_bad_form(self):
    with pytest.raises(ValueError, match="form='codes'"):
      fp4.fake_quant_record(jnp.ones((2, 16)), form="codes")
