"""How a kernel launches: `pallas_call` on Pallas' Triton backend, interpret mode off a GPU.

The bottom of `trace_jax.kernels`: every kernel module imports this one, and it imports
none of them. On a GPU the kernels compile through Pallas' Triton backend
(`triton_params`): the decode shapes are GEMV-like (1-64 rows) and memory bound, with FP4
decoded to bf16 in registers, which Triton tiles of any power-of-two size express
directly; Mosaic GPU wants 64-row warpgroup tiles staged whole in shared memory (a
[K/2, N] weight block does not fit). Elsewhere they run in Pallas interpret mode (exact but
slow, for tests) unless inside `compiled_kernels`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


_COMPILED = contextvars.ContextVar("trace_jax_compiled_kernels", default=False)


@contextlib.contextmanager
def compiled_kernels():
  """Kernels called inside default to their compiled form (interpret=False) even without a
  GPU: `cuda_lowering` lowers whole models for CUDA this way on any machine."""
  token = _COMPILED.set(True)
  try:
    yield
  finally:
    _COMPILED.reset(token)


def interpret_default(interpret: bool | None) -> bool:
  """Kernels compile on GPU and run in Pallas interpret mode anywhere else (unless inside
  `compiled_kernels`). Resolved before a kernel's jit, so the choice is part of its key."""
  if interpret is not None:
    return bool(interpret)
  return not (on_gpu() or _COMPILED.get())


def block_size(n: int, preferred: tuple[int, ...], what: str) -> int:
  """The largest of `preferred` that divides n (kernels tile without remainders)."""
  for b in preferred:
    if n % b == 0:
      return b
  raise ValueError(f"{what}={n} must be a multiple of one of {preferred}")


def row_tiling(m: int, block_m: int | None = None, largest: int = 64) -> tuple[int, int]:
  """(row tile, padded row count) for m rows: by default a power-of-two tile of at least 16
  (the smallest GPU dot tile) and at most `largest`."""
  if block_m is None:
    block_m = 16
    while block_m < min(m, largest):
      block_m *= 2
  return block_m, -(-m // block_m) * block_m


def pad_rows(a: jax.Array, rows: int, value=0) -> jax.Array:
  """a [m, ...] padded with `value` to `rows` rows (the row tiling's remainder)."""
  return jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1), constant_values=value)


def poisoned(shape, dtype):
  """A buffer whose every element shows if a kernel never writes it: NaN, or 0xFF bytes."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.full(shape, jnp.nan, dtype)
  return jnp.full(shape, jnp.iinfo(dtype).max, dtype)


def triton_params(num_warps: int, num_stages: int, what: str) -> pl_triton.CompilerParams:
  """Pallas' Triton compiler params, checked: warps per program (a power of two, 1-32) and
  software-pipelining stages of the kernel's inner loop (>= 1)."""
  if num_warps not in (1, 2, 4, 8, 16, 32):
    raise ValueError(f"{what}: num_warps={num_warps} must be a power of two in [1, 32]")
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"{what}: num_stages={num_stages} must be an int >= 1")
  return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(
  kernel,
  *,
  out_shape,
  grid,
  in_specs,
  out_specs,
  inputs,
  interpret: bool,
  num_warps: int,
  num_stages: int,
  poison: bool = False,
  name: str,
  aliases: dict[int, int] | None = None,
):
  """`pl.pallas_call` on the Triton backend (`num_warps`, `num_stages`; ignored in
  interpret mode), with two extras: `aliases` {input index: output index} updates inputs
  in place (a cache the kernel writes a few slots of), and `poison=True` fills the other
  outputs before the kernel runs (NaN, or 0xFF bytes; aliased, so the kernel writes into
  them) so that any element the kernel fails to write shows in the result. Tests use it;
  it costs a fill."""
  out_shape, out_specs = tuple(out_shape), tuple(out_specs)
  aliases = dict(aliases or {})
  params = triton_params(num_warps, num_stages, name)
  call = functools.partial(
    pl.pallas_call,
    out_shape=out_shape,
    grid=grid,
    out_specs=out_specs,
    interpret=interpret,
    name=name,
    compiler_params=None if interpret else params,
  )
  if not poison:
    return call(kernel, in_specs=list(in_specs), input_output_aliases=aliases)(*inputs)
  n_in, n_out = len(inputs), len(out_shape)
  fresh = [i for i in range(n_out) if i not in aliases.values()]
  buffers = [poisoned(out_shape[i].shape, out_shape[i].dtype) for i in fresh]

  def with_buffers(*refs):  # the poisoned buffers' input refs are output refs; skip them
    kernel(*refs[:n_in], *refs[n_in + len(fresh) :])

  return call(
    with_buffers,
    in_specs=[*in_specs, *(out_specs[i] for i in fresh)],
    input_output_aliases={**aliases, **{n_in + p: i for p, i in enumerate(fresh)}},
  )(*inputs, *buffers)
