"""The experts' grouped matmul: `layers.ragged_matmul` (tiled) against `jax.lax.ragged_dot`.

  python experiments/bench_grouped.py                 # the small preset's shapes, and more experts
  python experiments/bench_grouped.py --repeats=3     # quick

XLA lowers `jax.lax.ragged_dot` densely (every row against every expert's weights, one dot
with E times the work); `ragged_matmul` lays each expert's rows into whole tiles and runs one
batched matmul. Both are timed in the same run on the same random rows, weights and expert
sizes, forward alone and forward + backward (what a training step runs), with the dense
cost of the work itself beside them: one plain [R, in] @ [in, out] matmul, the floor no
grouping beats. Read the ratios: these machines are noisy.
"""

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.model.layers import ragged_matmul, tile_rows
from trace_jax.utils import markdown_table, time_jitted

_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions (median).")

# (what it is, rows, in, out, experts): rows are tokens x top-k
SHAPES = (
  ("small: RL train step (128 x 48 tokens, top-2)", 12288, 128, 128, 8),
  ("small: decode step (128 sequences, top-2)", 256, 128, 128, 8),
  ("small: SFT step (32 x 64 tokens, top-2)", 4096, 128, 128, 8),
  ("64 experts, top-8, 128 tokens", 1024, 256, 128, 64),
)


def _ragged_dot(lhs, w, sizes):
  """XLA's ragged_dot, as the model called it (float32 accumulation, lhs's dtype out)."""
  return jax.lax.ragged_dot(lhs, w, sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)


def _plain(lhs, w, sizes):
  """The same rows through one expert's weights: the work with no grouping at all."""
  del sizes
  return jnp.einsum("ri,io->ro", lhs, w[0], preferred_element_type=jnp.float32).astype(lhs.dtype)


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  rows_out = []
  for name, rows, width, out, experts in SHAPES:
    lhs = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, width, out)) / width**0.5, jnp.bfloat16)
    share = rng.dirichlet(np.ones(experts))  # uneven experts, as a router makes them
    sizes = np.floor(share * rows).astype(np.int32)
    sizes[0] += rows - sizes.sum()
    sizes = jnp.asarray(sizes)
    probe = jnp.asarray(rng.standard_normal((rows, out)), jnp.float32)
    ms = {}
    for label, fn in (("tiled", ragged_matmul), ("ragged_dot", _ragged_dot), ("plain", _plain)):
      forward = jax.jit(lambda a, b, fn=fn: fn(a, b, sizes))
      loss = lambda a, b, fn=fn: jnp.sum(fn(a, b, sizes).astype(jnp.float32) * probe)  # noqa: E731
      both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
      ms[label] = [1e3 * time_jitted(f, lhs, w, repeats=_REPEATS.value) for f in (forward, both)]
    for i, what in enumerate(("forward", "forward + backward")):
      rows_out.append(
        (
          name,
          what,
          tile_rows(rows, experts),
          f"{ms['ragged_dot'][i]:.2f}",
          f"{ms['tiled'][i]:.2f}",
          f"{ms['ragged_dot'][i] / ms['tiled'][i]:.1f}x",
          f"{ms['plain'][i]:.2f}",
          f"{ms['tiled'][i] / ms['plain'][i]:.2f}",
        )
      )
  print(f"backend: {jax.default_backend()}, bf16 rows and weights, median of {_REPEATS.value}\n")
  print(
    markdown_table(
      (
        "shape",
        "pass",
        "tile",
        "ragged_dot ms",
        "tiled ms",
        "speedup",
        "plain matmul ms",
        "tiled / plain",
      ),
      rows_out,
    )
  )


if __name__ == "__main__":
  app.run(main)
