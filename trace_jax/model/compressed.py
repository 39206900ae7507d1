"""Read compressed-tensors FP4 checkpoints (NVFP4 / MXFP4 "pack-quantized"): `from_hf` hook.

A compressed-tensors linear stores `<module>.weight_packed` (uint8 [out, in/2], element 2i
in the low nibble), `<module>.weight_scale` (E4M3 [out, in/16] for NVFP4, E8M0 uint8
[out, in/32] for MXFP4) and, for NVFP4, `<module>.weight_global_scale` (float32 [1], the
encode scale: x = code * scale / global_scale). `decompress` turns each into the
`<module>.weight` the plain Hugging Face mapping reads, in float32, with `fp4.dequantize`
(the same decoder the rollout uses, so re-quantizing gives the same codes). A static W4A4
`input_global_scale` is read and dropped: our rollout quantizes activations per token.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from trace_jax import fp4

FIELDS = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}


def quantized_format(hf: dict) -> str | None:
  """ "nvfp4" / "mxfp4" for a compressed-tensors FP4 config.json, None for a plain one.

  Raises:
    ValueError: a quantization_config this loader cannot read (another method or format).
  """
  qc = hf.get("quantization_config")
  if not qc:
    return None
  method = qc.get("quant_method")
  if method != "compressed-tensors":
    raise ValueError(
      f"quantization_config.quant_method={method!r} is not supported; only "
      "'compressed-tensors' (NVFP4 / MXFP4 pack-quantized)"
    )
  formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
  formats.discard(None)
  if len(formats) != 1 or next(iter(formats)) not in _FORMATS:
    raise ValueError(
      f"compressed-tensors format {sorted(formats)} is not supported; allowed: "
      f"{sorted(_FORMATS)} (one per checkpoint)"
    )
  return _FORMATS[formats.pop()]


def _array_like(value):
  """`value` as it is when it has a shape and dtype (a memory map stays unread), else an array."""
  return value if hasattr(value, "shape") and hasattr(value, "dtype") else np.asarray(value)


def _checked_fields(tensors, module: str, fmt: str):
  """(packed, scales, global scale [1, 1] float32) of one compressed-tensors linear, their
  dtypes and shapes checked from the headers (only the one-element global scale is read)."""
  packed = _array_like(tensors[f"{module}.weight_packed"])
  scales = _array_like(tensors[f"{module}.weight_scale"])
  if packed.dtype != np.uint8 or len(packed.shape) != 2:
    raise ValueError(
      f"{module}.weight_packed must be uint8 [out, in/2]; got {packed.dtype} {packed.shape}"
    )
  block = fp4.get_format(fmt).block_size
  if scales.shape != (packed.shape[0], packed.shape[1] * 2 // block):
    raise ValueError(
      f"{module}.weight_scale has shape {scales.shape}; weight_packed "
      f"{packed.shape} implies {(packed.shape[0], packed.shape[1] * 2 // block)}"
    )
  if fmt == "nvfp4":
    gs = np.asarray(tensors[f"{module}.weight_global_scale"], np.float32)
    if gs.size != 1:
      raise ValueError(f"{module}.weight_global_scale has shape {gs.shape}; expected [1]")
    global_scale = gs.reshape(1, 1)
  else:
    global_scale = np.ones((1, 1), np.float32)
  return packed, scales, global_scale


def _qarray(packed, scales, global_scale, fmt: str) -> fp4.QArray:
  return fp4.QArray(
    packed=jnp.asarray(np.asarray(packed)),
    scales=jnp.asarray(np.asarray(scales).view(np.uint8)),
    global_scale=jnp.asarray(global_scale),
    fmt=fmt,
    axis=-1,
  )


def module_qarray(tensors, module: str, fmt: str) -> fp4.QArray:
  """The packed weight of one compressed-tensors linear, in the HF [out, in] layout
  (quantized along the last axis)."""
  return _qarray(*_checked_fields(tensors, module, fmt), fmt)


class Dequantized:
  """The float32 `.weight` [out, in] of one compressed-tensors linear, dequantized slice by
  slice: `weight[rows, cols]` (basic slices) reads only those rows of the codes and scales
  and the blocks the columns touch, and equals `fp4.dequantize(module_qarray(...))[rows,
  cols]` bit for bit (the decode is elementwise per block). Header checks happen when it
  is made."""

  def __init__(self, tensors, module: str, fmt: str):
    self.packed, self.scales, self.global_scale = _checked_fields(tensors, module, fmt)
    self.fmt = fmt
    self.block = fp4.get_format(fmt).block_size
    self.shape = (self.packed.shape[0], self.packed.shape[1] * 2)
    self.ndim = 2
    self.dtype = np.dtype(np.float32)

  def __getitem__(self, index) -> np.ndarray:
    index = index if isinstance(index, tuple) else (index,)
    index = index + (slice(None),) * (2 - len(index))
    if len(index) != 2 or not all(isinstance(i, slice) for i in index):
      raise ValueError(f"a dequantized weight takes two basic slices; got {index}")
    rows = slice(*index[0].indices(self.shape[0]))
    start, stop, step = index[1].indices(self.shape[1])
    if rows.step != 1 or step != 1:
      raise ValueError(f"a dequantized weight takes slices of step 1; got {index}")
    stop = max(start, stop)
    lo = start // self.block * self.block
    hi = min(-(-stop // self.block) * self.block, self.shape[1])
    count = len(range(*rows.indices(self.shape[0])))
    if count == 0 or hi == lo:
      return np.zeros((count, stop - start), np.float32)
    q = _qarray(
      self.packed[rows, lo // 2 : hi // 2],
      self.scales[rows, lo // self.block : hi // self.block],
      self.global_scale,
      self.fmt,
    )
    return np.asarray(fp4.dequantize(q))[:, start - lo : stop - lo]

  def __array__(self, dtype=None, copy=None):
    whole = self[:, :]
    return whole if dtype is None else whole.astype(dtype)


def decompress(hf: dict, tensors: dict, *, lazy: bool = False) -> dict:
  """Tensors with every compressed-tensors FP4 linear replaced by its float32 `.weight`
  (with `lazy`, a `Dequantized`, decoded slice by slice when sliced); a plain checkpoint's
  tensors unchanged."""
  fmt = quantized_format(hf)
  if fmt is None:
    return tensors
  modules = sorted(n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed"))
  if not modules:
    raise ValueError(
      "config.json has a compressed-tensors quantization_config but the "
      "checkpoint holds no *.weight_packed tensors"
    )
  unknown = sorted(
    n
    for n in tensors
    if n.rsplit(".", 1)[-1].startswith(("weight_", "input_")) and n.rsplit(".", 1)[-1] not in FIELDS
  )
  if unknown:
    raise ValueError(
      f"compressed-tensors fields this loader does not read (asymmetric or "
      f"another scheme?): {unknown[:8]}"
    )
  out = dict(tensors)
  for module in modules:
    if lazy:
      out[f"{module}.weight"] = Dequantized(tensors, module, fmt)
    else:
      out[f"{module}.weight"] = np.asarray(fp4.dequantize(module_qarray(tensors, module, fmt)))
    for field in FIELDS:
      out.pop(f"{module}.{field}", None)
  return out
