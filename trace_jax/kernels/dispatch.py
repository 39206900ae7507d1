"""Which implementation runs: Pallas kernels on GPU, the XLA path elsewhere.

`kernels="auto"` (the default everywhere) picks Pallas where it compiles (a GPU backend)
and the XLA dequantize-then-dot path otherwise; "pallas" forces the kernels (on CPU they
run in interpret mode: exact but slow, for tests) and "xla" forces the XLA path.
`resolve_with_reason` also says why "auto" chose XLA, so runs can record it.

On a GPU the kernels compile through Pallas' Triton backend (`triton_params`): the decode
shapes are GEMV-like (1-64 rows) and memory bound, with FP4 decoded to bf16 in registers,
which Triton tiles of any power-of-two size express directly; Mosaic GPU wants 64-row
warpgroup tiles staged whole in shared memory (a [K/2, N] weight block does not fit).
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

KERNEL_MODES = ("auto", "pallas", "xla")


def check_mode(kernels: str, field: str = "kernels") -> str:
  if kernels not in KERNEL_MODES:
    raise ValueError(f"{field}={kernels!r} is not allowed; use one of {KERNEL_MODES}")
  return kernels


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve(kernels: str) -> str:
  """ "auto" | "pallas" | "xla" -> the implementation that runs: "pallas" or "xla".

  "auto" is Pallas on a GPU where the kernels compile (`probe`, once per process), else XLA.
  """
  return resolve_with_reason(kernels)[0]


def resolve_with_reason(kernels: str) -> tuple[str, str | None]:
  """`resolve`, plus why "auto" took the XLA path (None when it did not): runs record
  both, so a fallback on a GPU is never silent."""
  check_mode(kernels)
  if kernels != "auto":
    return kernels, None
  if not on_gpu():
    return "xla", f"auto: backend {jax.default_backend()} is not a GPU"
  failure = probe_failure()
  return ("xla", f"auto: probe failed: {failure}") if failure else ("pallas", None)


def probe(interpret: bool | None = None) -> bool:
  """Whether every kernel runs and matches its reference on small shapes here (cached).

  "auto" asks this before choosing Pallas, so a backend whose Pallas lowering fails falls
  back to the XLA path with a warning instead of failing a run.
  """
  return probe_failure(interpret) is None


@functools.cache
def probe_failure(interpret: bool | None = None) -> str | None:
  """None if the kernels pass the probe here, else why not (cached; warns once)."""
  try:
    # In a thread of its own: JAX's trace state is per thread, so the probe runs eagerly
    # even when "auto" is first resolved inside a jit trace.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      pool.submit(_probe, interpret).result()
  except Exception as error:  # noqa: BLE001 (any failure means: do not use the kernels here)
    reason = f"{type(error).__name__}: {str(error)[:500]}"
    logging.warning(
      "Pallas FP4 kernels unavailable on backend %s (%s); using the XLA path",
      jax.default_backend(),
      reason,
    )
    return reason
  return None


def _probe(interpret: bool | None) -> None:
  """Raise unless every kernel agrees with its reference on small random inputs: the fused
  quantize bit for bit (codes, block scales, global scales, guidance bits: it promises
  `fp4.quantize` exactly, ties included: bf16 inputs hit E2M1 midpoints), the others to
  a tight tolerance (they differ from their references only in summation order)."""
  # Imported here: the kernel modules import this one.
  from trace_jax import fp4  # noqa: PLC0415
  from trace_jax.kernels import decode_attention_lib as decode_attention  # noqa: PLC0415
  from trace_jax.kernels import fp4_matmul_lib as fp4_matmul  # noqa: PLC0415
  from trace_jax.kernels import moe_gmm_lib as moe_gmm  # noqa: PLC0415
  from trace_jax.kernels import quantize_lib as quantize  # noqa: PLC0415

  x = jax.random.normal(jax.random.key(0), (16, 64), jnp.float32)
  w = x.T @ x / 64
  xb = x.astype(jnp.bfloat16)
  wq, we = fp4.quantize(w, axis=0), fp4.quantize(jnp.stack([w, -w]), axis=1, global_group=0)
  sizes, lengths = jnp.array([9, 7], jnp.int32), jnp.array([11])
  cache, q = fp4.quantize(x.reshape(1, 16, 2, 32), global_group="row"), x[:1].reshape(1, 2, 32)
  xq = fp4.quantize(x, global_group="row")
  for fmt in ("nvfp4", "mxfp4"):
    got, want = quantize.quantize(xb, fmt, interpret=interpret), quantize.reference(xb, fmt)
    for name, a, b in zip(
      ("packed", "scales", "global_scale", "mantissa_bits"),
      (*_qarray_leaves(got[0]), got[1]),
      (*_qarray_leaves(want[0]), want[1]),
    ):
      if not bool(jnp.array_equal(a, b, equal_nan=True)):
        raise AssertionError(f"quantize ({fmt}): {name} differ from fp4.quantize")
  checks = {
    "fp4_matmul W4A16": (
      fp4_matmul.fp4_matmul(xb, wq, interpret=interpret),
      fp4_matmul.reference(xb, wq),
    ),
    "fp4_matmul W4A4": (
      fp4_matmul.fp4_matmul(xq, wq, interpret=interpret),
      fp4_matmul.reference(xq, wq),
    ),
    "moe_gmm": (
      moe_gmm.moe_gmm(xb, we, sizes, out_dtype=jnp.float32, interpret=interpret),
      moe_gmm.reference(xb, we, sizes, out_dtype=jnp.float32),
    ),
    "decode_attention": (
      decode_attention.decode_attention(q, cache, cache, lengths, interpret=interpret),
      decode_attention.reference(q, cache, cache, lengths),
    ),
  }
  for name, (got, want) in checks.items():
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(want)))
    if not bool(jnp.allclose(got, want, rtol=1e-3, atol=1e-3 * scale)):
      error = float(jnp.max(jnp.abs(got - want)))
      raise AssertionError(
        f"{name} disagrees with its reference (max error {error:.3g}, max |value| {scale:.3g})"
      )


def _qarray_leaves(q):
  return q.packed, q.scales, q.global_scale


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
):
  """`pl.pallas_call` on the Triton backend (`num_warps`, `num_stages`; ignored in
  interpret mode), with one extra: `poison=True` fills the outputs before the kernel runs
  (NaN, or 0xFF bytes; aliased, so the kernel writes into them) so that any element the
  kernel fails to write shows in the result. Tests use it; it costs a fill."""
  out_shape, out_specs = tuple(out_shape), tuple(out_specs)
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
    return call(kernel, in_specs=list(in_specs))(*inputs)
  n_in, n_out = len(inputs), len(out_shape)
  buffers = [poisoned(s.shape, s.dtype) for s in out_shape]

  def with_buffers(*refs):  # the aliased input refs are the output refs; skip them
    kernel(*refs[:n_in], *refs[n_in + n_out :])

  return call(
    with_buffers,
    in_specs=[*in_specs, *out_specs],
    input_output_aliases={n_in + i: i for i in range(n_out)},
  )(*inputs, *buffers)
