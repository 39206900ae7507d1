"""Weight sync: the rollout's copy of the policy parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.model.quant import QuantConfig, is_quantized_weight, quantize_weight


def quantize_params(params: nnx.State, quant: QuantConfig | None, *,
                    dtype=jnp.bfloat16) -> nnx.State:
  """The rollout's parameters, made once per weight sync.

  With an FP4 `quant`, every linear weight in its scope (`quant.sites`) becomes a packed `fp4.QArray` (per
  matrix, per expert for stacked experts): dequantizing it gives, bit for bit, the weight
  the training path fake-quantizes from the same master weights. Everything DESIGN.md keeps
  in high precision (embedding, LM head, router, norms, linear weights outside the scope)
  stays float32. Without FP4
  (`quant` None or precision "bf16") all parameters are cast to `dtype`.

  Args:
    params: `nnx.state(policy)`, float32 master weights.
    quant: the rollout's QuantConfig.
    dtype: dtype of the unquantized parameters of a bf16 rollout.
  """
  fp4_rollout = quant is not None and quant.enabled
  flat = []
  for path, variable in nnx.to_flat_state(params):
    value = variable.get_value()
    if not fp4_rollout:
      value = value.astype(dtype)
    elif is_quantized_weight(path, quant):
      value = quantize_weight(value, quant.fmt)
    flat.append((path, variable.replace(value)))
  return nnx.from_flat_state(flat)


def params_nbytes(params: nnx.State) -> int:
  """Bytes of a parameter state (packed weights count their packed bytes)."""
  return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params)))


quantize_params_jit = jax.jit(quantize_params, static_argnums=1, static_argnames="dtype")
