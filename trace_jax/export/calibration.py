"""Static input global scales for the W4A4 NVFP4 export, and how far they are from ours.

Our rollout quantizes every activation with its own per-token global scale; the W4A4
compressed-tensors scheme stores one static `input_global_scale` per linear (block scales
stay dynamic, per 16 elements). Calibration (the "static_minmax" observer of llm-compressor,
on the rollout's own activations):
  1. run the FP4 rollout forward (packed weights, the rollout's per-token quantization) over
     calibration token sequences, recording every quantized site;
  2. per (layer, site): amax = the largest per-token amax over the valid tokens
     (= 448 * 6 / the smallest recorded per-token global scale);
  3. input_global_scale = 448 * 6 / amax: no calibration token saturates; tokens with a
     smaller amax get block scales below the E4M3 top of the range (more relative
     rounding of the block scale, never underflow in practice).
One scale per (layer, site) serves every linear reading that site (q/k/v share attn_in;
all experts' gate/up share moe_in, as the fused kernels take one), and every expert's down
projection shares the layer's moe_mid scale.

`input_scale_distance` measures, on held-out sequences, how the static-scale activations
differ from the per-token ones the policy was trained against.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import fp4
from trace_jax.model.quant import CallOptions, QuantConfig, Recording
from trace_jax.model.sites import site_spec
from trace_jax.model.transformer import Transformer
from trace_jax.rollout.params import quantize_params


def _rollout_forward(
  policy: Transformer, quant: QuantConfig, tokens, mask, positions, dtype, recording: Recording
):
  """The rollout path's forward (packed weights) in `dtype`, recording what `recording` says."""
  graphdef, state = nnx.split(policy)
  packed = quantize_params(state, quant)
  positions = None if positions is None else jnp.asarray(positions)
  return nnx.merge(graphdef, packed)(
    jnp.asarray(tokens),
    mask=jnp.asarray(mask),
    positions=positions,
    quant=quant,
    options=CallOptions(recording=recording, compute_dtype=dtype),
  )


def _valid_rows(mask: np.ndarray, site_shape: tuple[int, ...]) -> np.ndarray:
  """Broadcast a [B, T] token mask to a site's leading (non-quantized) axes."""
  extra = len(site_shape) - 3  # [B, T, ..., n]: k/v add heads, moe_mid adds slots
  return np.broadcast_to(mask.reshape(mask.shape + (1,) * (extra + 1)), site_shape[:-1] + (1,))


def calibrate_input_scales(
  policy: Transformer, quant: QuantConfig, tokens, mask=None, *, positions=None, dtype=jnp.bfloat16
) -> dict[tuple[int, str], float]:
  """(layer, site) -> static NVFP4 input global scale (448 * 6 / amax over tokens).

  Args:
    policy: the Transformer to export.
    quant: the rollout's QuantConfig (NVFP4).
    tokens: int [B, T] calibration sequences (rollout prompts and responses).
    mask: bool [B, T], False for padding (default all valid).
    positions: int [B, T] RoPE positions (a rollout's, for left-padded prompts).
    dtype: compute dtype of the rollout.
  """
  if quant.fmt != "nvfp4":
    raise ValueError(f"static input global scales are NVFP4's; quant.fmt={quant.fmt!r}")
  tokens = np.asarray(tokens)
  mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask, bool)
  if tokens.ndim != 2 or mask.shape != tokens.shape or not mask.any():
    raise ValueError(
      f"tokens must be [B, T] with a matching mask holding a valid token; got "
      f"tokens {tokens.shape}, mask {mask.shape}"
    )
  out = _rollout_forward(policy, quant, tokens, mask, positions, dtype, Recording(form="full"))
  scales = {}
  for key, q in out.sites.items():
    if site_spec(key[1]).cache:  # cache entries, not linear inputs
      continue
    gs = np.asarray(q.global_scale, np.float32)
    valid = _valid_rows(mask, gs.shape)
    if np.isnan(gs[np.broadcast_to(valid, gs.shape)]).any():
      raise ValueError(f"calibration activations at {key} hold NaN or Inf")
    # The smallest per-token scale is 448 * 6 / (the largest per-token amax), exactly.
    scales[key] = float(np.min(np.where(valid, gs, np.inf)))
  return scales


def input_scale_distance(
  policy: Transformer,
  quant: QuantConfig,
  scales: dict[tuple[int, str], float],
  tokens,
  mask=None,
  *,
  positions=None,
  dtype=jnp.bfloat16,
) -> dict[str, float]:
  """How far static-scale FP4 activations are from the per-token ones, on `tokens`.

  Per site input x (recorded on the rollout forward), with x_t the per-token NVFP4
  fake-quantization and x_s the one with the calibrated static global scale:
    rel_l2            ||x_s - x_t|| / ||x_t|| over all sites' valid rows
    value_diff_frac   share of elements whose dequantized value differs between the two
                      (a block scale rounded differently changes every value of its block)
    code_diff_frac    share of elements whose 4-bit code differs
    err_token, err_static   ||x_t - x|| / ||x|| and ||x_s - x|| / ||x||: quantization
                      error of each against the unquantized activation
    saturated_frac    share of rows whose amax exceeds the calibrated amax (they clip;
                      0 on the calibration tokens themselves)
  """
  tokens = np.asarray(tokens)
  mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask, bool)
  out = _rollout_forward(policy, quant, tokens, mask, positions, dtype, Recording(inputs=True))
  sums = dict(
    diff=0.0,
    token=0.0,
    x=0.0,
    err_token=0.0,
    err_static=0.0,
    differ=0,
    code_differ=0,
    elements=0,
    saturated=0,
    rows=0,
  )
  for key, x in out.site_inputs.items():
    if key not in scales:
      continue
    x = x.astype(jnp.float32)
    q_token = fp4.quantize(x, "nvfp4", global_group="row")
    gs = jnp.full(x.shape[:-1] + (1,), scales[key], jnp.float32)
    q_static = fp4.quantize(x, "nvfp4", global_group="row", global_scale=gs)
    per_token, static = fp4.dequantize(q_token), fp4.dequantize(q_static)
    valid = _valid_rows(mask, x.shape)
    codes_differ = np.asarray(fp4.codes(q_token) != fp4.codes(q_static))
    sums["code_differ"] += int(np.sum(codes_differ & valid))
    x, per_token, static = (np.where(valid, np.asarray(a), 0.0) for a in (x, per_token, static))
    sums["diff"] += float(np.sum((static - per_token) ** 2))
    sums["token"] += float(np.sum(per_token**2))
    sums["x"] += float(np.sum(x**2))
    sums["err_token"] += float(np.sum((per_token - x) ** 2))
    sums["err_static"] += float(np.sum((static - x) ** 2))
    sums["differ"] += int(np.sum((static != per_token) & valid))
    sums["elements"] += int(np.sum(np.broadcast_to(valid, x.shape)))
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    # Beyond the f32 rounding of 448 * 6 / amax: the calibration's own largest row is not.
    sums["saturated"] += int(np.sum((amax > fp4.NVFP4_RANGE / scales[key] * (1 + 1e-6)) & valid))
    sums["rows"] += int(np.sum(valid))
  if not sums["elements"]:
    raise ValueError(
      "no calibrated site was found in the forward (are the scales for this policy?)"
    )
  return {
    "rel_l2": float(np.sqrt(sums["diff"] / sums["token"])),
    "value_diff_frac": sums["differ"] / sums["elements"],
    "code_diff_frac": sums["code_differ"] / sums["elements"],
    "err_token": float(np.sqrt(sums["err_token"] / sums["x"])),
    "err_static": float(np.sqrt(sums["err_static"] / sums["x"])),
    "saturated_frac": sums["saturated"] / sums["rows"],
  }
