"""Whether the Pallas kernels can be trusted here: the probe `kernels="auto"` asks first.

It sits above every kernel module (it runs them all) and below `dispatch`, which calls it
when resolving "auto". It runs eagerly, so "auto" is resolved outside any jit trace: the
rollout engine resolves it once and passes the result ("pallas" or "xla") on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from trace_jax import fp4
from trace_jax.fp4 import ties
from trace_jax.kernels.launch import on_gpu
from trace_jax.kernels import (
  decode_attention,
  gemm,
  grouped_gemm,
  kv_write,
  layout,
  moe,
  quantize,
  routing,
)


def probe(interpret: bool | None = None) -> bool:
  """Whether every kernel runs and matches its reference on small shapes here (cached).

  "auto" asks this before choosing Pallas, so a backend whose Pallas lowering fails falls
  back to the XLA path with a warning instead of failing a run.
  """
  return probe_failure(interpret) is None


@functools.cache
def probe_failure(interpret: bool | None = None) -> str | None:
  """None if the kernels pass the probe here, else why not (cached; warns once, and on a
  GPU prints one line: `kernels: auto probe failed (<why>), using xla`).

  Runs the kernels eagerly, so it refuses to run inside a jit trace (where nothing is
  cached): resolve "auto" outside jit (`dispatch.resolve`) and pass the result on."""
  if isinstance(jnp.zeros(()), jax.core.Tracer):
    raise RuntimeError(
      "the kernels' probe runs eagerly, not inside a jit trace: resolve kernels='auto' "
      "(trace_jax.kernels.resolve) outside jit and pass the result ('pallas' or 'xla') on"
    )
  try:
    _probe(interpret)
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
      q, b = quantize.quantize(x, fmt, interpret=interpret)
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
