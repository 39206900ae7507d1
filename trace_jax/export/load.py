"""Load a compressed-tensors FP4 checkpoint keeping its packed bytes for the rollout.

`model.from_hf` dequantizes such a checkpoint into float32 master weights (to train on).
`load_fp4` keeps the packed codes and scales themselves as the policy's `fp4.QArray`
weights, so `quantize_params` (the rollout engine's weight sync) passes them through and
the rollout multiplies with exactly the bytes in the files, nothing re-quantized.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import fp4
from trace_jax.export import names as names_lib
from trace_jax.model import compressed
from trace_jax.model.hf import _read_checkpoint, from_hf
from trace_jax.model.quant import is_quantized_weight
from trace_jax.model.transformer import Transformer


def _stack(parts: list[np.ndarray], targets: list[names_lib.Target]) -> np.ndarray:
  """Undo `names.hf_array`: transpose back to [in, out] and stack experts on axis 0."""
  ours = [np.swapaxes(p, -1, -2) if t.linear else p for p, t in zip(parts, targets)]
  return np.stack(ours) if targets[0].expert is not None else ours[0]


def load_fp4(path: str, dtype=jnp.float32) -> Transformer:
  """A Transformer whose FP4 linears hold the checkpoint's packed weights (QArrays).

  Linears the checkpoint keeps in high precision load as float arrays. The forward and the
  rollout engine use the QArrays as they are (dequantized in the forward, passed through by
  `quantize_params`); to train on the policy, load it with `from_hf` instead.

  Raises:
    ValueError: a plain (not compressed-tensors FP4) checkpoint, or any `from_hf` error.
  """
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  fmt = compressed.quantized_format(hf)
  if fmt is None:
    raise ValueError(f"{path} is not a compressed-tensors FP4 checkpoint (no quantization_config)")
  policy = from_hf(path, dtype)  # checks names, shapes and unused tensors
  tensors = _read_checkpoint(path)
  graphdef, state = nnx.split(policy)
  flat = []
  for param_path, variable in nnx.to_flat_state(state):
    targets = list(names_lib.targets(policy.cfg, param_path))
    if is_quantized_weight(variable) and f"{targets[0].module}.weight_packed" in tensors:
      parts = [compressed.module_qarray(tensors, t.module, fmt) for t in targets]
      gs = [np.asarray(q.global_scale) for q in parts]  # [1, 1] each
      packed = fp4.QArray(
        packed=jnp.asarray(_stack([np.asarray(q.packed) for q in parts], targets)),
        scales=jnp.asarray(_stack([np.asarray(q.scales) for q in parts], targets)),
        global_scale=jnp.asarray(np.stack(gs) if targets[0].expert is not None else gs[0]),
        fmt=fmt,
        axis=-2,
      )
      if packed.shape != variable.get_value().shape:
        raise ValueError(
          f"packed weight for {param_path} has shape {packed.shape}; the "
          f"config implies {variable.get_value().shape}"
        )
      variable = variable.replace(packed)
    flat.append((param_path, variable))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))
