"""One decode step of a model, lowered for CUDA on any machine: what a GPU would run.

`lower_decode_step` builds the rollout's parameters abstractly (`jax.eval_shape`: nothing is
allocated, so the published geometries fit a laptop), fuses them for the kernels as the
engine does, and lowers one token's forward over a cache of `length` slots for CUDA with
the kernels compiled (`kernels.cuda_lowering`). Tests count its Triton kernels and XLA ops;
`experiments/gpu_check.py` reports them beside its timings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import model as M
from trace_jax.kernels import cuda_lowering
from trace_jax.model.cache import init_cache
from trace_jax.rollout.params import fuse_for_kernels, quantize_params


def lower_decode_step(
  cfg: M.ModelConfig, batch: int, length: int, *, precision: str = "fp4", kernels: str = "pallas"
) -> jax.stages.Lowered:
  """One decode step (T = 1) of `cfg` at `batch` sequences over a `length`-slot cache, as
  the rollout engine runs it (bf16 compute, its parameters, no recording), lowered for CUDA.

  precision "fp4": NVFP4 weights, activations and cache (`QuantConfig()`); "bf16": none.
  kernels "pallas" (the FP4 kernels, fused siblings) or "xla".
  """
  quant = M.QuantConfig() if precision == "fp4" else None
  abstract = nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)

  def rollout_params(state):
    params = quantize_params(state, quant, dtype=jnp.bfloat16)
    return fuse_for_kernels(params) if kernels == "pallas" and quant else params

  params = jax.eval_shape(rollout_params, state)
  cache = jax.eval_shape(lambda: init_cache(cfg, batch, length, quant, dtype=jnp.bfloat16))
  options = M.CallOptions(compute_dtype="bfloat16", kernels=kernels)

  def step(params, cache, tokens):
    out = nnx.merge(graphdef, params)(tokens, cache=cache, quant=quant, options=options)
    return out.logits, out.cache

  tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  return cuda_lowering.lower(step, params, cache, tokens)
