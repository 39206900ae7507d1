"""Which implementation runs: Pallas kernels on GPU, the XLA path elsewhere.

`kernels="auto"` (the default everywhere) picks Pallas where it compiles (a GPU backend)
and the XLA dequantize-then-dot path otherwise; "pallas" forces the kernels (on CPU they
run in interpret mode: exact but slow, for tests) and "xla" forces the XLA path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

KERNEL_MODES = ("auto", "pallas", "xla")


def check_mode(kernels: str, field: str = "kernels") -> str:
  if kernels not in KERNEL_MODES:
    raise ValueError(f"{field}={kernels!r} is not allowed; use one of {KERNEL_MODES}")
  return kernels


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve(kernels: str) -> str:
  """"auto" | "pallas" | "xla" -> the implementation that runs: "pallas" or "xla"."""
  check_mode(kernels)
  if kernels == "auto":
    return "pallas" if on_gpu() else "xla"
  return kernels


def interpret_default(interpret: bool | None) -> bool:
  """Kernels compile on GPU and run in Pallas interpret mode anywhere else."""
  return (not on_gpu()) if interpret is None else bool(interpret)


def block_size(n: int, preferred: tuple[int, ...], what: str) -> int:
  """The largest of `preferred` that divides n (kernels tile without remainders)."""
  for b in preferred:
    if n % b == 0:
      return b
  raise ValueError(f"{what}={n} must be a multiple of one of {preferred}")


def row_block(m: int, largest: int = 64) -> int:
  """A power-of-two row tile for m rows (at least 16, the smallest GPU dot tile)."""
  b = 16
  while b < min(m, largest):
    b *= 2
  return b


def poisoned(shape, dtype):
  """A buffer whose every element shows if a kernel never writes it: NaN, or 0xFF bytes."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.full(shape, jnp.nan, dtype)
  return jnp.full(shape, jnp.iinfo(dtype).max, dtype)


def pallas_call(kernel, *, out_shape, grid, in_specs, out_specs, inputs, interpret: bool,
                poison: bool = False, name: str | None = None):
  """`pl.pallas_call` with one extra: `poison=True` fills the outputs before the kernel
  runs (NaN, or 0xFF bytes; aliased, so the kernel writes into them) so that any element
  the kernel fails to write shows in the result. Tests use it; it costs a fill."""
  out_shape, out_specs = tuple(out_shape), tuple(out_specs)
  if not poison:
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=list(in_specs),
                          out_specs=out_specs, interpret=interpret, name=name)(*inputs)
  n_in, n_out = len(inputs), len(out_shape)
  buffers = [poisoned(s.shape, s.dtype) for s in out_shape]

  def with_buffers(*refs):  # the aliased input refs are the output refs; skip them
    kernel(*refs[:n_in], *refs[n_in + n_out:])

  return pl.pallas_call(
      with_buffers, out_shape=out_shape, grid=grid, in_specs=[*in_specs, *out_specs],
      out_specs=out_specs, input_output_aliases={n_in + i: i for i in range(n_out)},
      interpret=interpret, name=name)(*inputs, *buffers)
