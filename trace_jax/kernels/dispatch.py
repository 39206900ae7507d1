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
import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
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
  """None if the kernels pass the probe here, else why not (cached; warns once, and on a
  GPU prints one line: `kernels: auto probe failed (<why>), using xla`)."""
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
    if on_gpu():  # a GPU run that loses its kernels says so once, where it starts
      print(f"kernels: auto probe failed ({' '.join(reason.split())}), using xla", flush=True)
    return reason
  return None


def _probe(interpret: bool | None) -> None:
  """Raise unless every path quantizes the tie oracle bit for bit as the host does
  (`tie_oracle`) and every kernel matches its reference on small random inputs (to a
  tight tolerance: they differ from their references only in summation order)."""
  failures = [f"{path}: {verdict}" for path, verdict in tie_oracle(interpret).items() if verdict]
  if failures:
    raise AssertionError("not bit-equal on the tie oracle: " + "; ".join(failures))
  for name, (got, want) in _parity_checks(interpret).items():
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(want)))
    if not bool(jnp.allclose(got, want, rtol=2e-2, atol=2e-2 * scale)):
      error = float(jnp.max(jnp.abs(got - want)))
      raise AssertionError(
        f"{name} disagrees with its reference (max error {error:.3g}, max |value| {scale:.3g})"
      )


def tie_oracle(interpret: bool | None = None, rows: int = 96) -> dict[str, str | None]:
  """Every path that quantizes activations, on `fp4.ties.tie_rows` (exact ties an inexact
  division flips), against the host's quantization of them: {path: None if bit-equal,
  else what differs}. The paths: XLA `fp4.quantize` and `fp4.fake_quant` (the training
  path and the XLA rollout), and each Pallas kernel that quantizes (the fused quantize, the
  FP4 GEMM's prologue, dense and grouped, the KV-cache write). `rows` of each kind
  (interpret mode on CPU is slow: tests take a few)."""
  # Imported here: the kernel modules import this one.
  from trace_jax import fp4  # noqa: PLC0415
  from trace_jax.fp4 import ties  # noqa: PLC0415
  from trace_jax.kernels import gemm, grouped_gemm, kv_write, quantize_lib, routing  # noqa: PLC0415

  x_host = ties.tie_rows(rows=rows)
  x = jnp.asarray(x_host)
  rows, width = x.shape
  verdicts = {}
  for fmt in ("nvfp4", "mxfp4"):
    codes, scale_bits, gs, values = ties.host_quantize(x_host, fmt)
    packed, bits = ties.pack_host(codes)
    want = {"packed": packed, "scales": scale_bits, "global_scale": gs, "bits": bits}

    def compare(path, **got):
      bad = [
        f"{name} ({int(np.sum(np.asarray(value) != want[name]))} differ)"
        for name, value in got.items()
        if not np.array_equal(np.asarray(value), want[name], equal_nan=True)
      ]
      verdicts[f"{path} ({fmt})"] = ", ".join(bad) or None

    try:
      q = jax.jit(lambda a: fp4.quantize(a, fmt, global_group="row"))(x)
      compare("xla quantize", packed=q.packed, scales=q.scales, global_scale=q.global_scale)
      fake = jax.jit(lambda a: fp4.fake_quant(a.astype(jnp.float32), fmt, global_group="row"))(x)
      same = np.array_equal(np.asarray(fake), values)
      verdicts[f"xla fake_quant, training path ({fmt})"] = None if same else "values differ"
      q, b = quantize_lib.quantize(x, fmt, interpret=interpret)
      compare(
        "pallas quantize", packed=q.packed, scales=q.scales, global_scale=q.global_scale, bits=b
      )
      w = fp4.quantize(jnp.ones((width, 32), jnp.float32), fmt, axis=0)
      for record in ("full", "compact"):
        _, r = gemm.fp4_gemm(x, w, quantize=fmt, record=record, interpret=interpret)
        fields = dict(scales=r.scales, global_scale=r.global_scale)
        fields.update(packed=r.packed) if record == "full" else fields.update(bits=r.mantissa_bits)
        compare(f"pallas gemm prologue, {record}", **fields)
      experts = jnp.stack([jnp.arange(rows) % 3, (jnp.arange(rows) + 1) % 3], axis=1)
      we = fp4.quantize(jnp.ones((3, width, 32), jnp.float32), fmt, axis=1, global_group=0)
      tiles = routing.route_tiles(experts, 3, 16)
      _, r = grouped_gemm.fp4_grouped_gemm(
        x, we, tiles, quantize=fmt, record="full", interpret=interpret
      )
      r = jax.tree.map(tiles.first_slots, r)
      compare(
        "pallas grouped gemm prologue",
        packed=r.packed,
        scales=r.scales,
        global_scale=r.global_scale,
      )
      if fmt == "nvfp4" or width % 32 == 0:
        cache = jax.tree.map(
          lambda a: jnp.zeros((1, rows, *a.shape[1:]), a.dtype),
          fp4.quantize(x[:, None], fmt, global_group="row"),
        )
        new = x.reshape(1, rows, 1, width)
        k, _, rk, _ = kv_write.write_kv(
          new, new, cache, cache, 0, record="compact", interpret=interpret
        )
        compare(
          "pallas kv write",
          packed=k.packed[0, :, 0],
          scales=k.scales[0, :, 0],
          global_scale=k.global_scale[0, :, 0],
          bits=rk.mantissa_bits[0, :, 0],
        )
    except Exception as error:  # noqa: BLE001 (a path that fails to run fails the probe)
      verdicts[f"running the paths ({fmt})"] = f"{type(error).__name__}: {str(error)[:300]}"
  return verdicts


def _parity_checks(interpret):
  """{kernel: (kernel output, reference output)} on small random inputs."""
  from trace_jax import fp4  # noqa: PLC0415
  from trace_jax.kernels import decode_attention_lib as decode_attention  # noqa: PLC0415
  from trace_jax.kernels import gemm, layout, moe  # noqa: PLC0415

  x = jax.random.normal(jax.random.key(0), (16, 64), jnp.float32)
  w = x.T @ x / 64
  xb = x.astype(jnp.bfloat16)
  wq = fp4.quantize(w, axis=0)
  we = fp4.quantize(jnp.stack([w, -w, 2 * w]), axis=1, global_group=0)
  qkv = layout.fuse([fp4.quantize(jnp.concatenate([w, -w, w, w], 0)[:, :32], axis=0)] * 2)
  x2 = jnp.concatenate([xb] * 4, axis=1)[:2]  # [2, 256]: two K steps to split
  experts = jnp.stack([jnp.arange(16) % 3, (jnp.arange(16) + 2) % 3], axis=1)
  lengths = jnp.array([11])
  cache, q = fp4.quantize(x.reshape(1, 16, 2, 32), global_group="row"), x[:1].reshape(1, 2, 32)
  y, h = moe.moe_experts(
    xb, experts, (we, we), we, quantize_in="nvfp4", quantize_mid="nvfp4", interpret=interpret
  )[:2]
  y_ref, h_ref = moe.reference(xb, experts, we, we, we, quantize_in="nvfp4", quantize_mid="nvfp4")
  return {
    "fp4_gemm W4A16": (
      gemm.fp4_gemm(xb, wq, interpret=interpret)[0],
      gemm.reference(xb, wq)[0],
    ),
    "fp4_gemm W4A4": (
      gemm.fp4_gemm(xb, wq, quantize="nvfp4", interpret=interpret)[0],
      gemm.reference(xb, wq, quantize="nvfp4")[0],
    ),
    "fp4_gemm W4A4 split-K, fused": (
      gemm.fp4_gemm(x2, qkv, quantize="nvfp4", k_splits=2, interpret=interpret)[0],
      gemm.reference(x2, qkv, quantize="nvfp4")[0],
    ),
    "moe_experts (gate|up)": (h, h_ref),
    "moe_experts (down)": (y, y_ref),
    "decode_attention": (
      decode_attention.decode_attention(q, cache, cache, lengths, interpret=interpret),
      decode_attention.reference(q, cache, cache, lengths),
    ),
  }


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
