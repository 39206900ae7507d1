"""The sparse-guidance part of the mismatch study (issue 16): calibrating `delta` from the
measured rollout/training value differences, and bytes at published geometries.

1. Calibration. For every guided site, |t_train - t_rollout|: the distance between the two
   paths' values of each element in units of the rollout value's E2M1 grid spacing (the
   training value under its own global scale and the rollout's block scales, as the sparse
   training path sees it; `fp4.sparse.boundary_noise`), and the same for the ideal block
   scales in E4M3 units. Its `quantile` (over the real tokens' elements) is the margin that
   covers that share of elements: an element farther than the margin from a midpoint
   cannot cross it. Measured with full guidance on every layer (the state sparse guidance
   aims at: every upstream site agrees) and, for contrast, with nearest rounding and
   routing replay (every layer's flips feeding the next).
2. Bytes at a geometry from measured densities: a sparse site costs, per element and per
   block, what it cost per element and per block in the study (`fp4.sparse.site_bits`,
   per site kind), times the element and block counts of that site at the geometry (from
   `jax.eval_shape` of a one-token forward). Golomb-Rice index deltas cost about
   log2(1/p) + 2 bits per flag at density p, independent of the row length, so the
   per-element cost carries over.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as guidance_lib
from trace_jax.fp4 import sparse as sparse_lib
from trace_jax.model.config import get_preset
from trace_jax.model.quant import QuantConfig, Recording, call_config, resolve_layers
from trace_jax.model.transformer import Transformer

GEOMETRIES = ("qwen3_30b_a3b", "qwen3_5_35b_a3b")
QUANTILES = (0.9, 0.99, 0.995, 0.999, 0.9999)


def site_deltas(calibration: dict, quantile: float) -> tuple:
  """Per-site-kind margins: for each site kind, the largest over layers of the per-site
  `quantile` of |t_train - t_rollout| (clipped to 0.5)."""
  out: dict = {}
  for name, row in calibration["per_site"].items():
    value = row["quantiles"].get(str(quantile))
    if value is not None:
      site = name.split("/", 1)[1]
      out[site] = min(max(out.get(site, 0.0), value), 0.5)
  return tuple(sorted(out.items()))


def _quantile(values: list, q: float) -> float | None:
  """The `q` quantile of the arrays in `values` pooled; None when they hold nothing."""
  pooled = np.concatenate(values) if values else np.empty(0)
  return float(np.quantile(pooled, q)) if pooled.size else None


def calibrate(
  rollout_sites, rollout_inputs, train_sites, train_inputs, mask, quantile: float
) -> dict:
  """The margins that cover `quantile` of the measured |t_train - t_rollout|.

  Args:
    rollout_sites: {(layer, site): fp4.QArray} the rollout recorded (full capture).
    rollout_inputs / train_inputs: {(layer, site): activation} of the two paths.
    train_sites: {(layer, site): fp4.QArray} of the training forward (its global scales).
    mask: bool [B, S], the real tokens.

  Returns:
    {"delta", "scale_delta" (pooled quantiles), "per_site": {"layer/site": {...}},
     "global_scale_differs_frac": the share of rows whose global scale differs between the
     paths, "elements", "quantile"}.
  """
  mask = np.asarray(mask, bool)
  pooled, pooled_blocks, per_site = [], [], {}
  gs_differs = gs_rows = 0
  for key in sorted(set(rollout_sites) & set(train_inputs) & set(rollout_inputs)):
    q_r = rollout_sites[key]
    element, block = sparse_lib.boundary_noise(
      train_inputs[key], rollout_inputs[key], q_r, train_sites[key].global_scale
    )
    element, block = np.asarray(element), np.asarray(block)
    rows = mask.reshape(mask.shape + (1,) * (element.ndim - 1 - mask.ndim))
    rows = np.broadcast_to(rows, element.shape[:-1])
    e, b = element[rows].ravel(), block[rows].ravel()
    e, b = e[np.isfinite(e)], b[np.isfinite(b)]
    pooled.append(e)
    pooled_blocks.append(b)
    differs = np.asarray(train_sites[key].global_scale != q_r.global_scale)[..., 0][rows]
    gs_differs += int(differs.sum())
    gs_rows += int(differs.size)
    per_site[f"{key[0]}/{key[1]}"] = {
      "quantiles": {str(p): _quantile([e], p) for p in QUANTILES},
      "delta": _quantile([e], quantile),
      "scale_delta": _quantile([b], quantile),
      "mean": float(e.mean()) if e.size else None,
      "above_0.5_frac": float(np.mean(e > 0.5)) if e.size else None,
    }
  return {
    "quantile": quantile,
    "delta": _quantile(pooled, quantile),
    "scale_delta": _quantile(pooled_blocks, quantile),
    "quantiles": {
      str(p): {"delta": _quantile(pooled, p), "scale_delta": _quantile(pooled_blocks, p)}
      for p in QUANTILES
    },
    "global_scale_differs_frac": gs_differs / max(gs_rows, 1),
    "elements": int(sum(p.size for p in pooled)),
    "per_site": per_site,
  }


def densities(guidance: guidance_lib.Guidance, mask) -> dict:
  """Measured sparse costs per site kind: {site: {"element_bits", "block_bits" (bits per
  element / per block: positions, bits and scales), "density", "block_density"}}, and
  "all" pooled over every site."""
  stats = guidance.sparse_stats(mask)["per_site"]
  kinds: dict = {}
  for (_, site), s in stats.items():
    for name in (site, "all"):
      k = kinds.setdefault(
        name, dict(element_bits=0, block_bits=0, elements=0, blocks=0, flagged=0, flagged_blocks=0)
      )
      k["element_bits"] += s["element_encodings"][s["element_encoding"]] + s["bits"]
      k["block_bits"] += s["block_encodings"][s["block_encoding"]] + s["scales"]
      for field in ("elements", "blocks", "flagged", "flagged_blocks"):
        k[field] += s[field]
  return {
    name: {
      "element_bits": k["element_bits"] / max(k["elements"], 1),
      "block_bits": k["block_bits"] / max(k["blocks"], 1),
      "density": k["flagged"] / max(k["elements"], 1),
      "block_density": k["flagged_blocks"] / max(k["blocks"], 1),
    }
    for name, k in kinds.items()
  }


def site_geometry(cfg, quant: QuantConfig) -> dict:
  """Per (layer, site) of a model: elements, blocks and rows (global scales) per token, and
  routing bytes per token, from `jax.eval_shape` of a one-token forward."""

  def capture():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    out = model(
      jnp.zeros((1, 1), jnp.int32), quant=call_config(quant, recording=Recording(form="compact"))
    )
    return out.sites, out.routing.astype(guidance_lib.routing_dtype(cfg.num_experts))

  sites, routing = jax.eval_shape(capture)
  out = {
    key: {
      "elements": int(np.prod(g.mantissa_bits.shape[2:])) * 8,
      "blocks": int(np.prod(g.scales.shape[2:])),
      "rows": int(np.prod(g.global_scale.shape[2:])),
    }
    for key, g in sites.items()
  }
  return {
    "sites": out,
    "routing": int(np.prod(routing.shape[3:]))
    * routing.shape[0]
    * np.dtype(routing.dtype).itemsize,
  }


def geometry_bytes(cfg_name: str, scope: str, costs: dict, fmt: str = "nvfp4") -> dict:
  """Guidance bytes per token at a published geometry, all with routing: compact on the
  deeper half and full on every layer (from shapes: their costs are fixed), sparse on every
  layer from the measured per-site-kind costs (`densities`; a site kind the study's model
  lacks takes the pooled cost)."""
  cfg = get_preset(cfg_name)
  geometry = site_geometry(cfg, QuantConfig(fmt=fmt, sites=scope))
  half = set(resolve_layers("last_half", cfg.num_layers))
  compact = full = sparse = 0.0
  for (layer, site), g in geometry["sites"].items():
    fixed = g["blocks"] + 4 * g["rows"]  # E4M3 block scales, f32 global scales
    full += g["elements"] / 2 + fixed
    if layer in half:
      compact += g["elements"] / 8 + fixed
    cost = costs.get(site, costs["all"])
    sparse += (g["elements"] * cost["element_bits"] + g["blocks"] * cost["block_bits"]) / 8
  routing = geometry["routing"]
  return {"compact": compact + routing, "full": full + routing, "sparse": sparse + routing}


def sparse_rows(
  full: guidance_lib.Guidance, inputs, deltas, spec: fp4.SparseSpec, mask, measure, site_specs=None
) -> list[dict]:
  """One study row per delta: sparse guidance of every layer derived from the full capture
  and the rollout's inputs (bit for bit what a sparse capture records), measured on the
  training path (`measure(guidance) -> row`), with its bytes, densities and overflow."""
  rows = []
  specs = [(spec.replace(delta=float(d)), {}) for d in deltas] + list(site_specs or ())
  for row_spec, extra in specs:
    delta = row_spec.delta
    guidance = full.to_sparse(inputs, row_spec)
    row = measure(guidance)
    stats = guidance.sparse_stats(mask)
    encodings = {}
    for s in stats["per_site"].values():
      for form, bits in s["element_encodings"].items():
        encodings[form] = encodings.get(form, 0) + bits / 8
    tokens = max(int(np.asarray(mask).sum()), 1)
    row.update(extra)
    row.update(
      {
        "delta": float(delta),
        "scale_delta": spec.scale_delta,
        "site_deltas": dict(row_spec.site_deltas),
        "bytes_per_token": guidance.bytes_per_token(mask),
        "bytes": {k: v / tokens for k, v in guidance.nbytes(mask).items()},
        "element_position_bytes_per_token": {k: v / tokens for k, v in encodings.items()},
        "density": stats["guidance/sparse_density"],
        "block_density": stats["guidance/sparse_block_density"],
        "overflow": stats["guidance/sparse_overflow"],
        "block_overflow": stats["guidance/sparse_block_overflow"],
        "costs": densities(guidance, mask),
      }
    )
    rows.append(row)
  return rows
