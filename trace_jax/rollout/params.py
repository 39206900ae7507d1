"""Weight sync: the rollout's copy of the policy parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import fp4
from trace_jax.model.quant import (
  QuantConfig,
  is_quantized_weight,
  quantize_weight_group,
  scale_groups,
)


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


def params_nbytes(params: nnx.State) -> int:
  """Bytes of a parameter state (packed weights count their packed bytes)."""
  return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params)))


quantize_params_jit = jax.jit(quantize_params, static_argnums=1, static_argnames="dtype")
