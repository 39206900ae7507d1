"""The sparse-guidance part of the mismatch study: calibrating `delta` from the
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

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as guidance_lib
from trace_jax.fp4 import sparse as sparse_lib
from trace_jax.model.config import get_preset
from trace_jax.model.quant import CallOptions, QuantConfig, Recording, resolve_layers
from trace_jax.model.transformer import Transformer

GEOMETRIES = ("qwen3_30b_a3b", "qwen3_5_35b_a3b")
QUANTILES = (0.9, 0.99, 0.995, 0.999, 0.9999)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Margins:
  """Margins that cover a share of the measured noise: elements in E2M1 grid units, block
  scales in E4M3 units (None where nothing was measured)."""

  delta: float | None
  scale_delta: float | None

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiteNoise:
  """|t_train - t_rollout| of one (layer, site), over the real tokens' elements."""

  quantiles: dict[str, float | None]  # {str(q): the q quantile}, q in QUANTILES
  margins: Margins  # at the calibration's quantile
  mean: float | None
  above_half_frac: float | None  # share beyond 0.5: flips no margin < 0.5 can catch

  def to_json(self) -> dict:
    return {
      "quantiles": self.quantiles,
      **self.margins.to_json(),
      "mean": self.mean,
      "above_0.5_frac": self.above_half_frac,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
  """The margins that cover `quantile` of the measured |t_train - t_rollout| (`calibrate`)."""

  quantile: float
  margins: Margins  # pooled over every site
  quantiles: dict[str, Margins]  # pooled, at each of QUANTILES
  global_scale_differs_frac: float  # share of rows whose global scale differs between paths
  elements: int
  per_site: dict[str, SiteNoise]  # by "layer/site"

  def to_json(self) -> dict:
    return {
      "quantile": self.quantile,
      **self.margins.to_json(),
      "quantiles": {q: m.to_json() for q, m in self.quantiles.items()},
      "global_scale_differs_frac": self.global_scale_differs_frac,
      "elements": self.elements,
      "per_site": {name: row.to_json() for name, row in self.per_site.items()},
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiteCost:
  """Measured sparse cost of a site kind: bits per element and per block (positions, bits
  and scales), and the flagged shares."""

  element_bits: float
  block_bits: float
  density: float
  block_density: float

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeometryBytes:
  """Guidance bytes per token at a geometry, all with routing."""

  compact: float  # deeper half
  full: float  # every layer
  sparse: float  # every layer, at the measured costs
  sparse_within: float | None = None  # the cheapest sparse row within 1.5x of compact's k3

  def to_json(self) -> dict:
    out = {"compact": self.compact, "full": self.full, "sparse": self.sparse}
    if self.sparse_within is not None:
      out["sparse_within_1.5x"] = self.sparse_within
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseRow:
  """One sparse-guidance row: what the training path measured under it (`measurement`, any
  object with a `to_json()` and a `k3_kl`) and what it cost."""

  measurement: object
  delta: float
  scale_delta: float
  site_deltas: dict[str, float]  # per-site-kind margins ({}: `delta` everywhere)
  site_quantile: float | None  # the calibration quantile of `site_deltas`
  bytes_per_token: float
  bytes: dict[str, float]  # per token, by part (positions, bits, scales, routing)
  element_position_bytes_per_token: dict[str, float]  # by position encoding
  density: float
  block_density: float
  overflow: int
  block_overflow: int
  costs: dict[str, SiteCost]  # by site kind, and "all"

  @property
  def k3_kl(self) -> float:
    return self.measurement.k3_kl

  def to_json(self) -> dict:
    out = self.measurement.to_json()
    if self.site_quantile is not None:
      out["site_quantile"] = self.site_quantile
    out.update(
      delta=self.delta,
      scale_delta=self.scale_delta,
      site_deltas=self.site_deltas,
      bytes_per_token=self.bytes_per_token,
      bytes=self.bytes,
      element_position_bytes_per_token=self.element_position_bytes_per_token,
      density=self.density,
      block_density=self.block_density,
      overflow=self.overflow,
      block_overflow=self.block_overflow,
      costs={name: cost.to_json() for name, cost in self.costs.items()},
    )
    return out


def site_deltas(calibration: Calibration, quantile: float) -> tuple:
  """Per-site-kind margins: for each site kind, the largest over layers of the per-site
  `quantile` of |t_train - t_rollout| (clipped to 0.5)."""
  out: dict = {}
  for name, row in calibration.per_site.items():
    value = row.quantiles.get(str(quantile))
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
) -> Calibration:
  """The margins that cover `quantile` of the measured |t_train - t_rollout|.

  Args:
    rollout_sites: {(layer, site): fp4.QArray} the rollout recorded (full capture).
    rollout_inputs / train_inputs: {(layer, site): activation} of the two paths.
    train_sites: {(layer, site): fp4.QArray} of the training forward (its global scales).
    mask: bool [B, S], the real tokens.
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
    per_site[f"{key[0]}/{key[1]}"] = SiteNoise(
      quantiles={str(p): _quantile([e], p) for p in QUANTILES},
      margins=Margins(delta=_quantile([e], quantile), scale_delta=_quantile([b], quantile)),
      mean=float(e.mean()) if e.size else None,
      above_half_frac=float(np.mean(e > 0.5)) if e.size else None,
    )

  def margins(p: float) -> Margins:
    return Margins(delta=_quantile(pooled, p), scale_delta=_quantile(pooled_blocks, p))

  return Calibration(
    quantile=quantile,
    margins=margins(quantile),
    quantiles={str(p): margins(p) for p in QUANTILES},
    global_scale_differs_frac=gs_differs / max(gs_rows, 1),
    elements=int(sum(p.size for p in pooled)),
    per_site=per_site,
  )


def densities(guidance: guidance_lib.Guidance, mask) -> dict[str, SiteCost]:
  """Measured sparse costs per site kind, and "all" pooled over every site."""
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
    name: SiteCost(
      element_bits=k["element_bits"] / max(k["elements"], 1),
      block_bits=k["block_bits"] / max(k["blocks"], 1),
      density=k["flagged"] / max(k["elements"], 1),
      block_density=k["flagged_blocks"] / max(k["blocks"], 1),
    )
    for name, k in kinds.items()
  }


def site_geometry(cfg, quant: QuantConfig) -> dict:
  """Per (layer, site) of a model: elements, blocks and rows (global scales) per token, and
  routing bytes per token, from `jax.eval_shape` of a one-token forward."""

  def capture():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    out = model(
      jnp.zeros((1, 1), jnp.int32),
      quant=quant,
      options=CallOptions(recording=Recording(form="compact")),
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


def geometry_bytes(
  cfg_name: str, scope: str, costs: dict[str, SiteCost], fmt: str = "nvfp4"
) -> GeometryBytes:
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
    sparse += (g["elements"] * cost.element_bits + g["blocks"] * cost.block_bits) / 8
  routing = geometry["routing"]
  return GeometryBytes(compact=compact + routing, full=full + routing, sparse=sparse + routing)


def sparse_rows(
  full: guidance_lib.Guidance,
  inputs,
  deltas,
  spec: fp4.SparseSpec,
  mask,
  measure: Callable[[guidance_lib.Guidance], object],
  site_specs=(),
) -> list[SparseRow]:
  """One row per delta (then per per-site spec of `site_specs`, (spec, quantile) pairs):
  sparse guidance of every layer derived from the full capture and the rollout's inputs
  (bit for bit what a sparse capture records), measured on the training path
  (`measure(guidance)`), with its bytes, densities and overflow."""
  rows = []
  specs = [(spec.replace(delta=float(d)), None) for d in deltas] + list(site_specs)
  for row_spec, site_quantile in specs:
    guidance = full.to_sparse(inputs, row_spec)
    measurement = measure(guidance)
    stats = guidance.sparse_stats(mask)
    encodings = {}
    for s in stats["per_site"].values():
      for form, bits in s["element_encodings"].items():
        encodings[form] = encodings.get(form, 0) + bits / 8
    tokens = max(int(np.asarray(mask).sum()), 1)
    rows.append(
      SparseRow(
        measurement=measurement,
        delta=float(row_spec.delta),
        scale_delta=spec.scale_delta,
        site_deltas=dict(row_spec.site_deltas),
        site_quantile=site_quantile,
        bytes_per_token=guidance.bytes_per_token(mask),
        bytes={k: v / tokens for k, v in guidance.nbytes(mask).items()},
        element_position_bytes_per_token={k: v / tokens for k, v in encodings.items()},
        density=stats["guidance/sparse_density"],
        block_density=stats["guidance/sparse_block_density"],
        overflow=stats["guidance/sparse_overflow"],
        block_overflow=stats["guidance/sparse_block_overflow"],
        costs=densities(guidance, mask),
      )
    )
  return rows
