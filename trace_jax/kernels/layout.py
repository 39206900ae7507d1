"""Sibling FP4 weights fused into the one matrix a kernel reads (made at weight sync).

q | k | v of an attention layer and gate | up of an expert share one global scale (they
declare one `scale_group` in their parameter metadata: the rollout and the trainer quantize
each group as one global group), so their packed codes and block scales can sit side by
side in one matrix that one FP4 GEMM reads with one global scale:

  q | k | v     columns concatenated:  [K/2, Nq + Nk + Nv]   (outputs split after the GEMM)
  gate | up     columns interleaved in tiles of `tile`: column block j of width 2 * tile
                holds gate columns [j * tile, (j + 1) * tile) then the same up columns,
                so the program that owns block j has both halves of SwiGLU's inputs.

The bytes are the per-matrix `QArray`s' own (a re-layout along the output axis, which the
quantization never crosses), so `FusedWeight.parts()` gives those back bit for bit: the
export reads the per-matrix weights of `rollout.quantize_params`, and nothing about the
numerics changes. The first sibling's variable holds the `FusedWeight`; the others hold a
`FusedPart` placeholder (no arrays), so the parameter tree keeps its names.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["packed", "scales", "global_scale"],
  meta_fields=["fmt", "widths", "tile"],
)
@dataclasses.dataclass(frozen=True)
class FusedWeight:
  """Siblings sharing one global scale, packed as one matrix [..., K, N_total] along K.

  Attributes:
    packed: uint8 [..., K/2, N_total].
    scales: uint8 [..., K/block, N_total].
    global_scale: float32 [..., 1, 1], the siblings' shared encode scale.
    fmt: "nvfp4" or "mxfp4".
    widths: each sibling's output width, in order.
    tile: None (columns concatenated) or the interleave tile of two siblings (gate | up).
  """

  packed: jax.Array
  scales: jax.Array
  global_scale: jax.Array
  fmt: str
  widths: tuple[int, ...]
  tile: int | None = None

  def qarray(self) -> fp4.QArray:
    """The fused matrix as one `fp4.QArray` along K (the kernel's view)."""
    return fp4.QArray(
      packed=self.packed, scales=self.scales, global_scale=self.global_scale, fmt=self.fmt, axis=-2
    )

  def parts(self) -> tuple[fp4.QArray, ...]:
    """The siblings' own `QArray`s, bit for bit as `quantize_weight_group` packs them."""
    fields = [_unfuse(a, self.widths, self.tile) for a in (self.packed, self.scales)]
    return tuple(
      fp4.QArray(packed=p, scales=s, global_scale=self.global_scale, fmt=self.fmt, axis=-2)
      for p, s in zip(*fields)
    )


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["index"])
@dataclasses.dataclass(frozen=True)
class FusedPart:
  """Placeholder for sibling `index` (> 0) of a `FusedWeight` held by sibling 0."""

  index: int


def _fuse(arrays: Sequence[jax.Array], tile: int | None) -> jax.Array:
  if tile is None:
    return jnp.concatenate(arrays, axis=-1)
  gate, up = arrays
  lead, width = gate.shape[:-1], gate.shape[-1]
  blocks = [a.reshape(*lead, width // tile, 1, tile) for a in (gate, up)]
  return jnp.concatenate(blocks, axis=-2).reshape(*lead, 2 * width)


def _unfuse(array: jax.Array, widths: tuple[int, ...], tile: int | None) -> list[jax.Array]:
  if tile is None:
    return jnp.split(array, np.cumsum(widths)[:-1].tolist(), axis=-1)
  lead, width = array.shape[:-1], widths[0]
  pairs = array.reshape(*lead, width // tile, 2, tile)
  return [pairs[..., i, :].reshape(*lead, width) for i in range(2)]


def fuse_arrays(arrays: Sequence[jax.Array], tile: int) -> jax.Array:
  """Two unquantized siblings [..., K, N] (bf16 gate, up) interleaved in column tiles of
  `tile`, as `fuse` lays out packed ones: the fair bf16 baseline's grouped GEMM reads it."""
  return _fuse(arrays, tile)


def fuse(parts: Sequence[fp4.QArray], *, tile: int | None = None) -> FusedWeight:
  """Siblings' `QArray`s [..., K, N_i] along K, sharing one global scale, as one matrix.

  `tile`: interleave two siblings (gate, up) in column tiles of that width (a power of
  two dividing both widths), for a SwiGLU epilogue; None: concatenate.
  """
  first = parts[0]
  widths = tuple(int(q.packed.shape[-1]) for q in parts)
  for q in parts:
    if q.axis != -2 or q.fmt != first.fmt or q.packed.shape[:-1] != first.packed.shape[:-1]:
      raise ValueError(
        "fuse: siblings must be QArrays of one format, quantized along K (axis -2), with "
        f"equal leading shapes; got {[(q.fmt, q.axis, q.packed.shape) for q in parts]}"
      )
  if tile is not None and (len(parts) != 2 or widths[0] != widths[1] or widths[0] % tile):
    raise ValueError(
      f"fuse: tile={tile} interleaves two siblings of one width divisible by it; got widths "
      f"{widths}"
    )
  return FusedWeight(
    packed=_fuse([q.packed for q in parts], tile),
    scales=_fuse([q.scales for q in parts], tile),
    global_scale=first.global_scale,
    fmt=first.fmt,
    widths=widths,
    tile=tile,
  )
