"""The private JAX internals trace_jax relies on, in one place.

JAX has no public API for these, and `jax._src` changes between releases without notice, so
every use of it in the package goes through this module, and `tests/test_jax_private.py`
checks each hook on the installed JAX (a JAX upgrade that moves one fails there, by name,
instead of deep inside a kernel lowering). Verified with the JAX minors in `TESTED_JAX`:
0.10.x (the test suite on CPU) and 0.11.2 (an H200: the package, tests/kernels and
experiments/gpu_check.py, the Pallas kernels compiled through these hooks). pyproject.toml
bounds jax to them.

What each is for:
- `apply_primitive`: the eager implementation of our own primitive (`fp4.numerics`'s exact
  division), as JAX's own primitives get it (`jax._src.dispatch.apply_primitive`).
- `register_triton_lowering`, `triton_lowering_rules`, `triton_inline_asm`: the Pallas
  Triton (CUDA) lowering of that primitive to inline PTX `div.rn.f32` (a plain float
  division lowers to the approximate div.full.f32 there, and Triton's `tt.precise_divf`
  becomes an LLVM `fdiv` that XLA's NVPTX backend, run with -nvptx-prec-divf32=1, compiles
  to div.full.f32 too); `precise_divf` is kept for the tests that show the difference.
- `hlo`: the StableHLO dialect, for the primitive's XLA lowering on GPUs (a float64
  division, see `fp4.numerics.true_divide`).
- `mlir_ir`, `new_triton_ir_context`: jaxlib's MLIR bindings and Pallas' Triton-dialect
  context, to print a lowered kernel's Triton module (`kernels.cuda_lowering`).
"""

from __future__ import annotations

import jax

TESTED_JAX = ((0, 10), (0, 11))  # (major, minor) of each JAX these hooks were verified with

try:
  from jax._src import dispatch as _dispatch
  from jax._src.lib.mlir import ir as mlir_ir  # noqa: F401 (re-exported)
  from jax._src.lib.mlir.dialects import hlo  # noqa: F401 (re-exported)
  from jax._src.lib.triton import dialect as _triton_dialect
  from jax._src.pallas.triton import lowering as _pallas_triton_lowering

  apply_primitive = _dispatch.apply_primitive
  precise_divf = _triton_dialect.precise_divf
  triton_inline_asm = _triton_dialect.elementwise_inline_asm
  register_triton_lowering = _pallas_triton_lowering.register_lowering
  triton_lowering_rules = _pallas_triton_lowering.triton_lowering_rules
  new_triton_ir_context = _pallas_triton_lowering._new_ir_context  # noqa: SLF001
except (ImportError, AttributeError) as e:  # pragma: no cover - only on another JAX
  raise ImportError(
    f"trace_jax needs JAX internals that jax {jax.__version__} does not have ({e}); they "
    f"were verified with jax {', '.join(f'{a}.{b}.x' for a, b in TESTED_JAX)}. Install one "
    f"of those, or update trace_jax/_jax_private.py and run tests/test_jax_private.py."
  ) from e
