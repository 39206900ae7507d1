"""Which implementation runs: Pallas kernels on GPU, the XLA path elsewhere.

`kernels="auto"` (the default everywhere) picks Pallas where it compiles (a GPU backend)
and the XLA dequantize-then-dot path otherwise; "pallas" forces the kernels (on CPU they
run in interpret mode: exact but slow, for tests) and "xla" forces the XLA path.
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental import pallas as pl

KERNEL_MODES = ("auto", "pallas", "xla")


def check_mode(kernels: str, field: str = "kernels") -> str:
  if kernels not in KERNEL_MODES:
    raise ValueError(f"{field}={kernels!r} is not allowed; use one of {KERNEL_MODES}")
  return kernels


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve(kernels: str) -> str:
  """"auto" | "pallas" | "xla" -> the implementation that runs: "pallas" or "xla".

  "auto" is Pallas on a GPU where the kernels compile (`probe`, once per process), else XLA.
  """
  check_mode(kernels)
  if kernels == "auto":
    return "pallas" if on_gpu() and probe() else "xla"
  return kernels


@functools.cache
def probe(interpret: bool | None = None) -> bool:
  """Whether every kernel runs and matches its reference on small shapes here (cached).

  "auto" asks this before choosing Pallas, so a backend whose Pallas lowering fails falls
  back to the XLA path with a warning instead of failing a run.
  """
  try:
    # In a thread of its own: JAX's trace state is per thread, so the probe runs eagerly
    # even when "auto" is first resolved inside a jit trace.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      pool.submit(_probe, interpret).result()
  except Exception as error:  # noqa: BLE001 (any failure means: do not use the kernels here)
    logging.warning("Pallas FP4 kernels unavailable on backend %s (%s: %s); using the XLA path",
                    jax.default_backend(), type(error).__name__, error)
    return False
  return True


def _probe(interpret: bool | None) -> None:
  # Imported here: the kernel modules import this one.
  from trace_jax import fp4  # noqa: PLC0415
  from trace_jax.kernels import decode_attention_lib as decode_attention  # noqa: PLC0415
  from trace_jax.kernels import fp4_matmul_lib as fp4_matmul  # noqa: PLC0415
  from trace_jax.kernels import moe_gmm_lib as moe_gmm  # noqa: PLC0415
  from trace_jax.kernels import quantize_lib as quantize  # noqa: PLC0415

  x = jax.random.normal(jax.random.key(0), (16, 64), jnp.float32)
  w = x.T @ x / 64
  wq, we = fp4.quantize(w, axis=0), fp4.quantize(jnp.stack([w, -w]), axis=1, global_group=0)
  sizes, lengths = jnp.array([9, 7], jnp.int32), jnp.array([11])
  cache, q = fp4.quantize(x.reshape(1, 16, 2, 32), global_group="row"), x[:1].reshape(1, 2, 32)
  xq, bits = quantize.quantize(x, interpret=interpret)
  ref_q, ref_bits = quantize.reference(x)
  checks = {
      "fp4_matmul": (fp4_matmul.fp4_matmul(x, wq, interpret=interpret),
                     fp4_matmul.reference(x, wq)),
      "moe_gmm": (moe_gmm.moe_gmm(x, we, sizes, interpret=interpret),
                  moe_gmm.reference(x, we, sizes)),
      "decode_attention": (decode_attention.decode_attention(q, cache, cache, lengths,
                                                             interpret=interpret),
                           decode_attention.reference(q, cache, cache, lengths)),
      "quantize": (fp4.dequantize(xq), fp4.dequantize(ref_q)),
      "quantize bits": (bits, ref_bits),
  }
  for name, (got, want) in checks.items():
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    if not bool(jnp.allclose(got, want, rtol=1e-3, atol=1e-3 * float(jnp.max(jnp.abs(want))))):
      raise AssertionError(f"{name} disagrees with its reference")


def interpret_default(interpret: bool | None) -> bool:
  """Kernels compile on GPU and run in Pallas interpret mode anywhere else."""
  return (not on_gpu()) if interpret is None else bool(interpret)


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
