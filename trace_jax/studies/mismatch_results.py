"""The mismatch study's results as typed values: one mode's `Measurement`, a guided-layer
sweep's `LayerRow`, the `Targets` the study checks, and the `MismatchStudy` they make up
(`to_json()`: the JSON experiments/mismatch.py writes). `studies.mismatch` computes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trace_jax.studies import sparse as sparse_study

# The log-probability mismatch fields every mode reports (`rl.metrics.mismatch_metrics`).
REPORTED = ("k3_kl", "kl", "logp_abs_diff", "prob_diff_mean", "prob_diff_max")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurement:
  """The training path against the rollout, on the sampled tokens: the mismatch of the
  log-probabilities (`rl.metrics.mismatch_metrics`), and where both paths quantize, how
  their FP4 outcomes differ (`fp4_disagreement`) and how guidance was followed."""

  k3_kl: float
  kl: float
  logp_abs_diff: float
  prob_diff_mean: float
  prob_diff_max: float
  is_ratio_mean: float
  is_ratio_max: float
  is_ratio_min: float
  tis_clip_frac: float
  code_disagree_frac: float | None = None  # None: nothing quantized (or no codes recorded)
  one_step_frac: float | None = None  # of the disagreeing codes, one grid step apart
  mantissa_disagree_frac: float | None = None
  scale_disagree_frac: float | None = None
  per_layer: dict | None = None  # {layer: the four fractions}; None: nothing quantized
  followed_frac: float | None = None  # None: nothing guided
  fallbacks: int | None = None

  @classmethod
  def of(cls, mismatch: dict, disagreement: dict | None, agreement: dict) -> "Measurement":
    """From `mismatch_metrics`, `fp4_disagreement` (None: bf16) and `guidance_agreement`."""
    names = ("mismatch/" + n for n in ("k3_kl", "kl", "logp_abs_diff", "prob_diff_mean"))
    fields = dict(zip(("k3_kl", "kl", "logp_abs_diff", "prob_diff_mean"), names))
    fields.update(prob_diff_max="mismatch/prob_diff_max", tis_clip_frac="tis/clip_frac")
    fields.update({f"is_ratio_{s}": f"is_ratio/{s}" for s in ("mean", "max", "min")})
    out = {field: mismatch[key] for field, key in fields.items()}
    if disagreement is not None:
      kinds = ("code_disagree_frac", "one_step_frac", "mantissa_disagree_frac")
      out.update({k: disagreement[k] for k in kinds + ("scale_disagree_frac", "per_layer")})
    if agreement:
      out.update(
        followed_frac=agreement["guidance/followed_frac"],
        fallbacks=agreement["guidance/fallbacks"],
      )
    return cls(**out)

  def to_json(self) -> dict:
    out = {name: getattr(self, name) for name in REPORTED}
    out.update({f"is_ratio/{s}": getattr(self, f"is_ratio_{s}") for s in ("mean", "max", "min")})
    out["tis/clip_frac"] = self.tis_clip_frac
    out.update(code_disagree_frac=self.code_disagree_frac, one_step_frac=self.one_step_frac)
    if self.per_layer is not None:
      out.update(
        mantissa_disagree_frac=self.mantissa_disagree_frac,
        scale_disagree_frac=self.scale_disagree_frac,
        per_layer=self.per_layer,
      )
    if self.followed_frac is not None:
      out.update({"guidance/followed_frac": self.followed_frac})
      out.update({"guidance/fallbacks": self.fallbacks})
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerRow:
  """Compact or full guidance on the top `guided_layers` layers (the layer sweep)."""

  mode: str
  guided_layers: int
  k3_kl: float
  kl: float
  logp_abs_diff: float
  prob_diff_max: float
  code_disagree_frac: float | None
  bytes_per_token: float

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseTarget:
  """The cheapest sparse row whose k3 is within 1.5x of compact's, and its bytes against
  full and compact guidance."""

  compact_k3: float
  best: sparse_study.SparseRow | None  # None: no swept row gets there
  full_over_sparse: float | None = None  # bytes: full guidance (every layer) / the best row
  compact_over_sparse: float | None = None  # bytes: compact (deeper half) / the best row

  def to_json(self) -> dict:
    out = {"compact_k3": self.compact_k3, "within_1.5x": None}
    if self.best is not None:
      b = self.best
      out["within_1.5x"] = {
        "delta": b.delta,
        "k3_kl": b.k3_kl,
        "bytes_per_token": b.bytes_per_token,
        "full_over_sparse": self.full_over_sparse,
        "compact_over_sparse": self.compact_over_sparse,
        "site_deltas": b.site_deltas,
        "costs": {name: cost.to_json() for name, cost in b.costs.items()},
      }
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Targets:
  """Guidance against nearest rounding *with* routing replay, so that it is not credited
  with what replay removes (`replay_k3_reduction` shows that part on its own)."""

  full_k3_reduction: float  # k3 none+replay / full
  compact_k3_reduction: float  # k3 none+replay / compact
  replay_k3_reduction: float  # k3 none / none+replay
  bytes_ratio_full_over_compact: float
  sparse: SparseTarget

  def to_json(self) -> dict:
    out = {
      "full_k3_reduction": self.full_k3_reduction,
      "compact_k3_reduction": self.compact_k3_reduction,
      "replay_k3_reduction": self.replay_k3_reduction,
      "bytes_ratio_full_over_compact": self.bytes_ratio_full_over_compact,
    }
    out["sparse"] = self.sparse.to_json()
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class MismatchStudy:
  """The study's results (`to_json()`: the JSON experiments/mismatch.py writes)."""

  config: Any  # studies.mismatch.StudyConfig (its to_json() is the JSON's "config")
  preset: str
  layers: int
  guided_half: tuple[int, ...]
  modes: dict  # {mode: Measurement, "sparse": SparseRow}, MODES
  bytes_per_token: dict[str, float]  # compact (deeper half), full (all), sparse (at delta)
  qwen3_30b_a3b_bytes_per_token: dict  # {scope: {"compact", "full"}}
  sweep: list[LayerRow]
  sparse_sweep: list[sparse_study.SparseRow]
  sparse_calibration: dict[str, sparse_study.Calibration]  # full_guidance, nearest_replay
  sparse_geometry_bytes_per_token: dict  # {geometry: {scope: sparse.GeometryBytes}}
  targets: Targets
  sft_nll: tuple[float | None, float | None]  # the warm start's first and final NLL
  response_tokens: int
  fp4_reward_mean: float
  kernels: tuple[str, str | None]  # the FP4 rollout's implementation, why "auto" fell back
  seconds: float

  def to_json(self) -> dict:
    dtype = self.config.compute_dtype
    return {
      "config": self.config.to_json(),
      "model": {
        "preset": self.preset,
        "layers": self.layers,
        "guided_half": list(self.guided_half),
      },
      "compute_dtype": {
        "rollout": f"{dtype} activations, one-token decode steps over the KV cache (FP4 "
        "weights dequantized on the fly, FP4 KV cache)",
        "training": f"{dtype} activations, whole-sequence prefill from float32 master weights "
        "fake-quantized to FP4",
        "high_precision": "router, norms (float32 inside), attention softmax and LM head in "
        "float32",
      },
      "modes": {mode: row.to_json() for mode, row in self.modes.items()},
      "bytes_per_token": self.bytes_per_token,
      "qwen3_30b_a3b_bytes_per_token": self.qwen3_30b_a3b_bytes_per_token,
      "sweep": [row.to_json() for row in self.sweep],
      "sparse_sweep": [row.to_json() for row in self.sparse_sweep],
      "sparse_calibration": {k: c.to_json() for k, c in self.sparse_calibration.items()},
      "sparse_geometry_bytes_per_token": {
        name: {scope: b.to_json() for scope, b in scopes.items()}
        for name, scopes in self.sparse_geometry_bytes_per_token.items()
      },
      "targets": self.targets.to_json(),
      "sft": {
        "steps": self.config.sft_steps,
        "first_nll": self.sft_nll[0],
        "final_nll": self.sft_nll[1],
      },
      "rollout": {
        "sequences": self.config.rollouts,
        "response_tokens": self.response_tokens,
        "fp4_reward_mean": self.fp4_reward_mean,
      },
      "kernels": {"rollout": self.kernels[0], "fallback_reason": self.kernels[1]},
      "seconds": self.seconds,
    }
