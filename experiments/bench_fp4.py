"""FP4 quantize / dequantize / fake_quant throughput against a plain jitted copy.

  python experiments/bench_fp4.py                 # 4096 x 4096 float32
  python experiments/bench_fp4.py --size=1024 --repeats=3   # a quick smoke run

Every figure is measured in the same run as the copy baseline; GB/s counts the float32
input tensor's bytes (size * size * 4) so the rows are comparable with the copy.
"""

from absl import app, flags
import jax
import jax.numpy as jnp

from trace_jax import fp4
from trace_jax.utils import markdown_table, time_jitted

_SIZE = flags.DEFINE_integer("size", 4096, "Rows and columns of the float32 tensor.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed repetitions (median reported).")


def main(argv):
  del argv
  n = _SIZE.value
  x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  nbytes = x.size * 4
  copy_s = time_jitted(jax.jit(jnp.copy), x, repeats=_REPEATS.value)
  rows = [("copy (baseline)", "-", "-", copy_s)]
  for fmt in ("nvfp4", "mxfp4"):
    q = fp4.quantize(x, fmt, global_group="row")
    compact = fp4.compact_guidance(q)
    x_other = x.astype(jnp.bfloat16).astype(jnp.float32)  # a nearby training-path value
    cases = [
      ("quantize", "nearest", jax.jit(lambda x: fp4.quantize(x, fmt, global_group="row")), (x,)),
      (
        "quantize",
        "guided compact",
        jax.jit(lambda x, g: fp4.quantize(x, fmt, rounding="guided", guidance=g)),
        (x_other, compact),
      ),
      (
        "quantize",
        "guided full",
        jax.jit(lambda x, g: fp4.quantize(x, fmt, rounding="guided", guidance=g)),
        (x_other, q),
      ),
      ("dequantize", "-", jax.jit(fp4.dequantize), (q,)),
      (
        "fake_quant",
        "nearest",
        jax.jit(lambda x: fp4.fake_quant(x, fmt, global_group="row")),
        (x,),
      ),
      (
        "fake_quant",
        "guided compact",
        jax.jit(lambda x, g: fp4.fake_quant(x, fmt, rounding="guided", guidance=g)),
        (x_other, compact),
      ),
    ]
    for op, rounding, fn, args in cases:
      rows.append((f"{fmt} {op}", rounding, fmt, time_jitted(fn, *args, repeats=_REPEATS.value)))
  table = [
    (
      name,
      rounding,
      f"{seconds * 1e3:.2f}",
      f"{nbytes / seconds / 1e9:.2f}",
      f"{seconds / copy_s:.1f}x",
    )
    for name, rounding, _, seconds in rows
  ]
  print(
    f"\n{n} x {n} float32 ({nbytes / 1e6:.0f} MB), backend {jax.default_backend()}, "
    f"{jax.device_count()} device(s)\n"
  )
  print(markdown_table(["op", "rounding", "ms", "GB/s (f32 input)", "time / copy"], table))


if __name__ == "__main__":
  app.run(main)
