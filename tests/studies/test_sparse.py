"""The sparse-guidance study (trace_jax/studies/sparse.py): the calibration against the NVFP4
definitions computed by hand, the per-site margins, and the bytes at a geometry against the
rollout's own byte accounting, on the tiny preset."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.model.config import get_preset
from trace_jax.model.quant import QuantConfig
from trace_jax.rollout.accounting import guidance_bytes_per_token
from trace_jax.rollout.config import RolloutConfig
from trace_jax.studies import sparse


def _hand_noise(x_r: np.ndarray, x_t: np.ndarray) -> np.ndarray:
  """|t_train - t_rollout| per element, from the NVFP4 definitions (DESIGN.md section 1):
  per-token gs = 448 * 6 / amax, block scales e4m3(amax_b / 6 * gs) of the rollout, values
  v = x / (s_b / gs) with each path's own gs, in units of the rollout value's E2M1 spacing
  (0.5 below 2, 1 below 4, 2 above)."""
  f32 = np.float32
  gs_r = f32(448 * 6) / np.max(np.abs(x_r), axis=-1, keepdims=True)
  gs_t = f32(448 * 6) / np.max(np.abs(x_t), axis=-1, keepdims=True)
  blocks_r = x_r.reshape(*x_r.shape[:-1], -1, 16)
  blocks_t = x_t.reshape(*x_t.shape[:-1], -1, 16)
  ideal = np.max(np.abs(blocks_r), axis=-1) / f32(6) * gs_r
  s_b = np.minimum(ideal, f32(448)).astype(ml_dtypes.float8_e4m3fn).astype(f32)
  v_r = blocks_r / (s_b / gs_r)[..., None]
  v_t = blocks_t / (s_b / gs_t)[..., None]
  spacing = np.where(np.abs(v_r) < 2, f32(0.5), np.where(np.abs(v_r) < 4, f32(1), f32(2)))
  return (np.abs(v_t - v_r) / spacing).reshape(x_r.shape), (gs_r != gs_t)[..., 0]


def test_calibration_is_the_quantile_of_the_hand_computed_noise():
  rng = np.random.default_rng()
  shape = (2, 5, 32)  # [B, S, width]: two blocks per token
  x_r = rng.normal(size=shape).astype(np.float32)
  x_t = (x_r + rng.normal(scale=0.02, size=shape)).astype(np.float32)
  x_t[0, 0] = x_r[0, 0]  # one token the paths agree on exactly
  mask = rng.uniform(size=shape[:2]) < 0.7
  mask[0, 0] = True
  key = (1, "moe_in")
  quantize = lambda x: fp4.quantize(jnp.asarray(x), global_group="row")  # noqa: E731
  quantile = 0.9
  calibration = sparse.calibrate(
    {key: quantize(x_r)}, {key: jnp.asarray(x_r)}, {key: quantize(x_t)}, {key: jnp.asarray(x_t)},
    mask, quantile,
  )  # fmt: skip
  noise, gs_differs = _hand_noise(x_r, x_t)
  real = noise[mask].ravel()
  np.testing.assert_allclose(calibration.margins.delta, np.quantile(real, quantile), rtol=1e-5)
  site = calibration.per_site["1/moe_in"]
  np.testing.assert_allclose(site.mean, real.mean(), rtol=1e-5)
  assert site.above_half_frac == pytest.approx(np.mean(real > 0.5))
  for q in sparse.QUANTILES:
    np.testing.assert_allclose(site.quantiles[str(q)], np.quantile(real, q), rtol=1e-5)
  assert calibration.elements == real.size == int(mask.sum()) * shape[-1]
  assert calibration.global_scale_differs_frac == pytest.approx(np.mean(gs_differs[mask]))
  assert 0 < calibration.global_scale_differs_frac < 1  # the agreeing token shares its gs
  json = calibration.to_json()
  assert json["per_site"]["1/moe_in"]["above_0.5_frac"] == site.above_half_frac
  assert set(json) == {
    "quantile",
    "delta",
    "scale_delta",
    "quantiles",
    "global_scale_differs_frac",
    "elements",
    "per_site",
  }


def test_site_deltas_take_the_largest_layer_per_site_kind_clipped_to_a_half():
  rng = np.random.default_rng()
  values = rng.uniform(0, 0.4, size=3)

  def site(value):
    margins = sparse.Margins(delta=None, scale_delta=None)
    return sparse.SiteNoise(quantiles={"0.99": value}, margins=margins, mean=0, above_half_frac=0)

  calibration = sparse.Calibration(
    quantile=0.99,
    margins=sparse.Margins(delta=0.1, scale_delta=0.1),
    quantiles={},
    global_scale_differs_frac=0.0,
    elements=1,
    per_site={
      "0/moe_in": site(values[0]),
      "1/moe_in": site(values[1]),
      "1/k": site(values[2] + 0.5),  # beyond a half: clipped
      "2/v": site(None),  # nothing measured there
    },
  )
  assert sparse.site_deltas(calibration, 0.99) == (
    ("k", 0.5),
    ("moe_in", max(values[0], values[1])),
  )


@pytest.mark.parametrize("scope", ["all", "experts+kv"])
def test_geometry_bytes_agree_with_the_rollouts_accounting(scope):
  """Compact (deeper half) and full (every layer) bytes from the site shapes equal the
  rollout's own accounting (`guidance_bytes_per_token`); sparse bytes are linear in the
  measured per-element and per-block costs, on top of the routing."""
  cfg = get_preset("tiny")
  base = RolloutConfig(precision="fp4", fp4=QuantConfig(sites=scope))
  cost = sparse.SiteCost(element_bits=1.5, block_bits=3.0, density=0.1, block_density=0.1)
  double = sparse.SiteCost(element_bits=3.0, block_bits=6.0, density=0.1, block_density=0.1)
  got = sparse.geometry_bytes("tiny", scope, {"all": cost})
  compact = base.replace(guidance="compact", guided_layers="last_half")
  assert got.compact == pytest.approx(guidance_bytes_per_token(cfg, compact))
  full = base.replace(guidance="full", guided_layers="all")
  assert got.full == pytest.approx(guidance_bytes_per_token(cfg, full))
  routing = guidance_bytes_per_token(cfg, full.replace(guided_layers="none"))  # routing only
  twice = sparse.geometry_bytes("tiny", scope, {"all": double})
  assert twice.sparse - routing == pytest.approx(2 * (got.sparse - routing))
  assert got.to_json().keys() == {"compact", "full", "sparse"}
