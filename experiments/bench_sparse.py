"""What sparse guidance adds to a rollout site's capture, against compact capture.

  python experiments/bench_sparse.py                  # decode step: 64 tokens x 2048
  python experiments/bench_sparse.py --rows=256 --width=768

Times one jitted site quantization (values and record, as `model.quantizer.quantize_site` runs it
in a decode step) per record form, median of --repeats, and prints the ratio to compact:
whether the sparse capture is hot enough to deserve a fused Pallas kernel.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from trace_jax import fp4
from trace_jax.model.quantizer import quantize_site
from trace_jax.utils import markdown_table

_ROWS = flags.DEFINE_integer("rows", 64, "Rows (tokens of a decode step).")
_WIDTH = flags.DEFINE_integer("width", 2048, "Elements per row (Qwen3-30B-A3B d_model).")
_REPEATS = flags.DEFINE_integer("repeats", 50, "Timed calls per form.")


def _time(fn, x) -> float:
  jax.block_until_ready(fn(x))  # compile
  times = []
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main(argv):
  del argv
  x = jax.random.normal(jax.random.key(0), (_ROWS.value, _WIDTH.value)).astype(jnp.bfloat16)
  rows = []
  base = None
  for form in ("none", "compact", "full", "sparse"):
    fn = jax.jit(
      lambda x, form=form: quantize_site(
        x, "nvfp4", rounding={}, form=form, kernels="xla", sparse=fp4.SparseSpec()
      )[:2]
    )
    seconds = _time(fn, x)
    base = seconds if form == "compact" else base
    rows.append((form, f"{seconds * 1e6:.0f}"))
  rows = [(form, us, f"{float(us) / (base * 1e6):.2f}x") for form, us in rows]
  print(f"\nsite capture, {_ROWS.value} x {_WIDTH.value} bf16, XLA on {jax.devices()[0].platform}")
  print(markdown_table(["record form", "us / call (median)", "vs compact"], rows))


if __name__ == "__main__":
  app.run(main)
