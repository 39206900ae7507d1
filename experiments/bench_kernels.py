"""Pallas FP4 kernels against the XLA dequantize-then-compute path and against bf16 (wall
time with a sync per call: a quick look; `experiments/gpu_check.py` measures device time).

  python experiments/bench_kernels.py                # on a GPU: Qwen3-30B-A3B decode shapes
  python experiments/bench_kernels.py --smoke        # tiny shapes (the CPU default)

At decode shapes (batch 1 to 256 query tokens, a long KV cache) each kernel is timed
beside the XLA path the model takes without kernels (dequantize, then dot/attend) and the
bf16 computation, in the same run. "bytes" counts what the computation must read from
memory (weights or cache in their stored format, plus activations) and GB/s is bytes over
time, shown against a copy's bandwidth measured in the same run and as a share of the
roofline (bytes / --peak_gbps, 4.8 TB/s for an H200): decode is bound by these bytes,
which is why FP4 (4.5 bits per element with scales) can beat bf16 (16 bits).

On CPU the kernels run in Pallas interpret mode (Python-speed emulation), so the default
there is a tiny smoke configuration: it checks that everything runs, not how fast.
"""

from __future__ import annotations

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4, kernels
from trace_jax.kernels import quantize as quantize_lib
from trace_jax.model import layers
from trace_jax.model.attention import attend
from trace_jax.model.quantizer import quantize_weight_group
from trace_jax.utils import markdown_table, time_jitted

_SMOKE = flags.DEFINE_bool("smoke", None, "Tiny shapes (default: on unless on a GPU).")
_BATCHES = flags.DEFINE_list("batches", None, "Decode batch sizes (default 1,32,256; smoke 1,4).")
_KV_LEN = flags.DEFINE_integer("kv_len", None, "KV-cache slots (default 4096; smoke 64).")
_REPEATS = flags.DEFINE_integer("repeats", None, "Timed repetitions (default 20; smoke 2).")
_PEAK = flags.DEFINE_float(
  "peak_gbps", 4800.0, "HBM bandwidth of the roofline, GB/s (H200: 4800; H100 SXM: 3350)."
)

# Qwen3-30B-A3B: d_model 2048, 32 query / 4 KV heads of 128, 128 experts (top 8) of 768.
FULL = dict(
  d_model=2048, q_out=4096, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, ffn=768
)
SMOKE = dict(d_model=64, q_out=64, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2, ffn=32)


def _nbytes(*trees) -> int:
  return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(trees)))


def _copy_bandwidth(nbytes: int, repeats: int) -> float:
  x = jnp.zeros((nbytes // 4,), jnp.float32)
  seconds = time_jitted(jax.jit(lambda a: a + 1.0), x, repeats=repeats)
  return 2 * x.size * 4 / seconds  # read + write


def _cases(shape, batch, kv_len, rng):
  """(kernel, [(impl, fn, args, bytes)]) for one batch size."""
  d, f, e, k = shape["d_model"], shape["ffn"], shape["experts"], shape["top_k"]
  keys = jax.random.split(rng, 8)
  bf16 = jnp.bfloat16
  x = jax.random.normal(keys[0], (batch, d), bf16)
  out = []

  # fp4_gemm: the q projection [d, q_out], x quantized per token in the prologue (W4A4).
  w = jax.random.normal(keys[1], (d, shape["q_out"]), jnp.float32) * 0.02
  wq, wb = fp4.quantize(w, axis=0), w.astype(bf16)
  out.append(
    (
      "fp4_gemm",
      [
        (
          "pallas",
          jax.jit(lambda x, w: kernels.fp4_gemm(x, w, quantize="nvfp4")[0]),
          (x, wq),
          _nbytes(x, wq),
        ),
        (
          "xla quantize+dequant+dot",
          jax.jit(
            lambda x, w: layers.matmul(
              fp4.fake_quant(x.astype(jnp.float32), global_group="row").astype(bf16),
              fp4.dequantize(w, bf16),
            )
          ),
          (x, wq),
          _nbytes(x, wq),
        ),
        ("bf16", jax.jit(layers.matmul), (x, wb), _nbytes(x, wb)),
      ],
    )
  )

  # moe_experts: batch tokens routed to top_k experts, gate|up (SwiGLU) then down.
  experts = jax.random.randint(keys[2], (batch, k), 0, e)
  wg, wu, wd = (
    jax.random.normal(kk, shape_, jnp.float32) * 0.02
    for kk, shape_ in zip(jax.random.split(keys[4], 3), ((e, d, f), (e, d, f), (e, f, d)))
  )
  gate_up = quantize_weight_group([wg, wu], "nvfp4")
  down = fp4.quantize(wd, axis=1, global_group=0)
  used = int(np.unique(np.asarray(experts)).size)  # only touched experts must be read
  fp4_bytes = _nbytes(x) + (_nbytes(gate_up) + _nbytes(down)) * used // e
  bf16_w = tuple(a.astype(bf16) for a in (wg, wu, wd))

  def fair_bf16(x, experts, wg, wu, wd):  # reads only the routed experts' weights
    g, u, dn = wg[experts], wu[experts], wd[experts]  # [B, k, ...] gathers
    h = jax.nn.silu(jnp.einsum("bd,bkdf->bkf", x, g)) * jnp.einsum("bd,bkdf->bkf", x, u)
    return jnp.einsum("bkf,bkfd->bkd", h.astype(bf16), dn)

  out.append(
    (
      "moe_experts",
      [
        (
          "pallas",
          jax.jit(
            lambda x, ex, gu, dn: kernels.moe_experts(
              x, ex, gu, dn, quantize_in="nvfp4", quantize_mid="nvfp4"
            )[0]
          ),
          (x, experts, gate_up, down),
          fp4_bytes,
        ),
        (
          "bf16 gather of the routed experts",
          jax.jit(fair_bf16),
          (x, experts, *bf16_w),
          _nbytes(x) + _nbytes(bf16_w) * used // e,
        ),
      ],
    )
  )

  # decode_attention over a full cache.
  hkv, dh, h = shape["kv_heads"], shape["head_dim"], shape["heads"]
  q = jax.random.normal(keys[5], (batch, h, dh), bf16)
  kv = jax.random.normal(keys[6], (2, batch, kv_len, hkv, dh), jnp.float32)
  kq, vq = (fp4.quantize(a, global_group="row") for a in kv)
  kb, vb = kv.astype(bf16)
  lengths = jnp.full((batch,), kv_len, jnp.int32)

  keep = jnp.ones((batch, 1, kv_len), bool)

  def attention(q, k, v):  # the model's attention (one query token), over a dequantized cache
    k, v = (fp4.dequantize(a, bf16) if isinstance(a, fp4.QArray) else a for a in (k, v))
    return attend(q[:, None], k, v, keep)[:, 0]

  out.append(
    (
      "decode_attention",
      [
        ("pallas", jax.jit(kernels.fp4_decode_attention), (q, kq, vq, lengths), _nbytes(q, kq, vq)),
        ("xla dequant+attend", jax.jit(attention), (q, kq, vq), _nbytes(q, kq, vq)),
        ("bf16", jax.jit(attention), (q, kb, vb), _nbytes(q, kb, vb)),
      ],
    )
  )

  # quantize: activations of the batch, codes + scales + guidance bits out.
  xa = jax.random.normal(keys[7], (batch, d), bf16)
  q_out = _nbytes(quantize_lib.reference(xa))  # codes, scales, global scales, guidance bits
  out.append(
    (
      "quantize",
      [
        (
          "pallas (fused, + guidance bits)",
          jax.jit(kernels.fused_quantize),
          (xa,),
          _nbytes(xa) + q_out,
        ),
        (
          "xla quantize + mantissa_bits",
          jax.jit(quantize_lib.reference),
          (xa,),
          _nbytes(xa) + q_out,
        ),
        ("bf16 copy", jax.jit(lambda a: a + 0), (xa,), 2 * _nbytes(xa)),
      ],
    )
  )
  return out


def main(argv):
  del argv
  on_gpu = jax.default_backend() == "gpu"
  smoke = (not on_gpu) if _SMOKE.value is None else _SMOKE.value
  shape = SMOKE if smoke else FULL
  batches = [int(b) for b in (_BATCHES.value or (["1", "4"] if smoke else ["1", "32", "256"]))]
  kv_len = _KV_LEN.value or (64 if smoke else 4096)
  repeats = _REPEATS.value or (2 if smoke else 20)
  start = time.time()
  copy = _copy_bandwidth(1 << (24 if smoke else 30), repeats)
  rows = []
  for batch in batches:
    for kernel, impls in _cases(shape, batch, kv_len, jax.random.key(batch)):
      baseline = None
      for impl, fn, args, nbytes in impls:
        seconds = time_jitted(fn, *args, repeats=repeats, warmup=1)
        baseline = baseline or seconds  # the first row (the kernel) is the reference time
        rows.append(
          (
            kernel,
            batch,
            impl,
            f"{seconds * 1e3:.3f}",
            f"{nbytes / 1024:.1f}",
            f"{nbytes / seconds / 1e9:.1f}",
            f"{nbytes / seconds / copy:.0%}",
            f"{nbytes / seconds / (_PEAK.value * 1e9):.0%}",
            f"{seconds / baseline:.2f}x",
          )
        )
  mode = "interpret mode (CPU emulation: not a speed figure)" if not on_gpu else "compiled"
  print(
    f"\n{'smoke' if smoke else 'Qwen3-30B-A3B decode'} shapes {shape}, KV {kv_len} slots; "
    f"backend {jax.default_backend()}, kernels {mode}; copy bandwidth {copy / 1e9:.1f} GB/s; "
    f"{time.time() - start:.0f} s\n"
  )
  print(
    markdown_table(
      [
        "kernel",
        "batch",
        "implementation",
        "ms",
        "KiB read",
        "GB/s",
        "of copy BW",
        f"of roofline ({_PEAK.value:.0f} GB/s)",
        "time / pallas",
      ],
      rows,
    )
  )


if __name__ == "__main__":
  app.run(main)
