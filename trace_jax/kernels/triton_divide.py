"""The Pallas Triton (CUDA) lowering of `fp4.true_divide`: inline PTX `div.rn.f32`.

`fp4.numerics.true_divide` binds one primitive (`true_divide_p`) that every backend lowers to
the correctly rounded float32 quotient (its docstring says why FP4 rounding needs exactly
that, and gives XLA's lowerings). This is the lowering inside Pallas kernels on a GPU. It
lives with the kernels and is registered when `trace_jax.kernels` is imported (every kernel
module is imported through that package), so the FP4 numerics import no Pallas or Triton
module.

Why inline assembly: Triton lowers a plain float division to div.full.f32 (up to 2 ulp off),
and its `tt.precise_divf` to an LLVM fdiv that XLA (which compiles a Pallas kernel's LLVM
with its own NVPTX options, -nvptx-prec-divf32=1) turns into div.full.f32 as well; inline
assembly is left alone by both.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.interpreters import mlir

from trace_jax import _jax_private
from trace_jax.fp4.numerics import true_divide_p

# PTX's correctly rounded float32 division (IEEE, round to nearest even): no flag reaches it.
DIV_RN_F32 = "div.rn.f32 $0, $1, $2;"

_triton = _jax_private.pallas_triton()


@_triton.register_lowering(true_divide_p)
def _triton_true_divide(ctx, numerator, denominator):
  aval = ctx.avals_out[0]
  result = mlir.dtype_to_ir_type(jnp.dtype(aval.dtype))
  if aval.shape:
    result = _jax_private.mlir_ir.RankedTensorType.get(aval.shape, result)
  return _triton.inline_asm(
    [result],
    DIV_RN_F32,
    constraints="=f,f,f",
    pure=True,
    packed_element=1,
    args=[numerator, denominator],
  )
