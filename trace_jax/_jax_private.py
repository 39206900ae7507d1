"""The private JAX internals trace_jax relies on, in one place.

JAX has no public API for these, and `jax._src` changes between releases without notice, so
every use of it in the package goes through this module, and `tests/test_jax_private.py`
checks each hook on the installed JAX (a JAX upgrade that moves one fails there, by name,
instead of deep inside a kernel lowering). Verified with the JAX minors in `TESTED_JAX`:
0.10.x (the test suite on CPU) and 0.11.2 (an H200: the package, tests/kernels and
experiments/gpu_check.py, the Pallas kernels compiled through these hooks). pyproject.toml
bounds jax to them.

What each is for:
- `apply_primitive`, `Primitive`: our own primitive (`fp4.numerics`'s exact division) and its
  eager implementation, as JAX's own primitives get it (`jax._src.dispatch.apply_primitive`).
  `Primitive` is the class `jax.extend.core.Primitive` names, taken from `jax._src.core`:
  importing `jax.extend` imports `jax.extend.pallas`, hence Pallas' core, and the FP4
  numerics import no Pallas module.
- `hlo`: the StableHLO dialect, for the primitive's XLA lowering on GPUs (a float64
  division, see `fp4.numerics.true_divide`).
- `mlir_ir`: jaxlib's MLIR bindings.
- `pallas_triton()`, imported on first use (by `trace_jax.kernels`), so that
  `import trace_jax.fp4` imports no Pallas or Triton module: `register_lowering`,
  `lowering_rules`, `inline_asm` for the Pallas Triton (CUDA) lowering of that primitive to
  inline PTX `div.rn.f32` (`kernels.triton_divide`: a plain float division lowers to the
  approximate div.full.f32 there, and Triton's `tt.precise_divf` becomes an LLVM `fdiv`
  that XLA's NVPTX backend, run with -nvptx-prec-divf32=1, compiles to div.full.f32 too;
  `precise_divf` is kept for the tests that show the difference); `new_ir_context`, Pallas'
  Triton-dialect context, to print a lowered kernel's Triton module
  (`kernels.cuda_lowering`).
"""

from __future__ import annotations

import functools
import types

import jax

TESTED_JAX = ((0, 10), (0, 11))  # (major, minor) of each JAX these hooks were verified with


def _unsupported(error: Exception) -> ImportError:
  return ImportError(
    f"trace_jax needs JAX internals that jax {jax.__version__} does not have ({error}); they "
    f"were verified with jax {', '.join(f'{a}.{b}.x' for a, b in TESTED_JAX)}. Install one "
    f"of those, or update trace_jax/_jax_private.py and run tests/test_jax_private.py."
  )


try:
  from jax._src import core as _core
  from jax._src import dispatch as _dispatch
  from jax._src.lib.mlir import ir as mlir_ir  # noqa: F401 (re-exported)
  from jax._src.lib.mlir.dialects import hlo  # noqa: F401 (re-exported)

  apply_primitive = _dispatch.apply_primitive
  Primitive = _core.Primitive
except (ImportError, AttributeError) as e:  # pragma: no cover - only on another JAX
  raise _unsupported(e) from e


@functools.cache
def pallas_triton() -> types.SimpleNamespace:
  """Pallas' Triton (CUDA) lowering hooks (see the module docstring), imported here on the
  first call: only `trace_jax.kernels` and the tests ask for them."""
  try:
    from jax._src.lib.triton import dialect
    from jax._src.pallas.triton import lowering

    return types.SimpleNamespace(
      register_lowering=lowering.register_lowering,
      lowering_rules=lowering.triton_lowering_rules,
      new_ir_context=lowering._new_ir_context,  # noqa: SLF001
      inline_asm=dialect.elementwise_inline_asm,
      precise_divf=dialect.precise_divf,
    )
  except (ImportError, AttributeError) as e:  # pragma: no cover - only on another JAX
    raise _unsupported(e) from e
