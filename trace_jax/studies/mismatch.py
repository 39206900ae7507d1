"""The mismatch study: how much training-inference mismatch TRACE guidance removes.

1. Warm-start a policy with SFT on a built-in task, so its distributions are not uniform.
2. Sample a batch of FP4 rollouts (W4A4 + FP4 KV, decode one token at a time) that capture
   full guidance on every layer plus routing; every guidance variant studied is derived from
   this one capture (compact = the codes' mantissa bits; fewer layers = a subset), so all
   modes score the very same samples. A separate bf16 rollout gives the bf16 floor.
3. Recompute the sampled tokens' log-probabilities on the training path (whole sequences,
   prefill shapes) under each mode and compare with what the rollout reported. Modes:
   "bf16" (both paths bf16), "none" (FP4 QAT, nearest rounding, the path's own routing),
   "none+replay" (nearest rounding with the rollout's experts: what routing replay alone
   removes), "compact" and "full" (guided, with replay), "sparse" (guided on every layer at
   the default `delta`, with replay; `rl.sparse_study`). Guidance is judged against
   "none+replay", so it is not credited with what replay removes.
4. Sparse guidance: calibrate `delta` from the measured |t_train - t_rollout| per site, sweep
   `delta` (k3, code disagreement, bytes/token, densities, overflow), and scale the measured
   per-element costs to the Qwen3-30B-A3B and Qwen3.5-35B-A3B geometries.

No noise is injected anywhere: the paths differ only as real systems do (decode vs prefill
shapes and reduction orders, bf16 rounding, XLA's fusion of the rollout's step).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import fp4
from trace_jax.kernels import check_mode as check_kernels
from trace_jax.model.config import get_preset, qwen3_30b_a3b
from trace_jax.model.quant import SITE_SCOPES, QuantConfig, Recording, call_config, resolve_layers
from trace_jax.model.transformer import Transformer
from trace_jax.rl import data
from trace_jax.studies import sparse as sparse_study
from trace_jax.rl.metrics import fp4_disagreement, guidance_agreement, mismatch_metrics
from trace_jax.rollout.accounting import guidance_bytes_per_token
from trace_jax.rollout.config import RolloutConfig, SamplingConfig
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.tasks.registry import get_task
from trace_jax.tasks.tokenizer import CharTokenizer
from trace_jax.training.forward import training_forward
from trace_jax.training.sft import sft_batch, train_sft
from trace_jax.utils import round_up

MODES = ("bf16", "none", "none+replay", "compact", "full", "sparse")
REPORTED = ("k3_kl", "kl", "logp_abs_diff", "prob_diff_mean", "prob_diff_max")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyConfig:
  """The study's knobs (the script's flags)."""

  preset: str = "small"
  task: str = "arith"
  seed: int = 0
  sft_steps: int = 300  # warm start
  sft_batch: int = 32
  sft_lr: float = 3e-3
  rollouts: int = 64  # sequences in the studied batch
  new_tokens: int = 48
  temperature: float = 1.0
  compute_dtype: str = "bfloat16"  # both paths, as in production
  fmt: str = "nvfp4"
  fp4_sites: str = "all"  # FP4 scope: "all" or "experts+kv"
  kernels: str = "auto"  # the FP4 rollout's implementation: "auto", "pallas" or "xla"
  delta: float = fp4.DEFAULT_DELTA  # sparse guidance's margin: modes["sparse"] is at it
  delta_sweep: tuple = (0.0, 0.005, 0.01, 0.02, 0.035, 0.05, 0.1, 0.15)  # sparse rows beside it
  delta_quantile: float = 0.999  # the share of |t_train - t_rollout| the calibration covers
  geometries: bool = True  # bytes at the Qwen3-30B-A3B / Qwen3.5-35B-A3B geometries (traces)
  layer_sweep: bool = True  # compact / full by number of guided layers (a compile each)

  def __post_init__(self):
    check_kernels(self.kernels, "StudyConfig.kernels")
    object.__setattr__(self, "delta_sweep", tuple(float(d) for d in self.delta_sweep))
    for d in (self.delta, *self.delta_sweep):
      fp4.SparseSpec(delta=d)  # a ValueError naming delta and its range
    if not 0 < self.delta_quantile < 1:
      raise ValueError(f"StudyConfig.delta_quantile={self.delta_quantile} must lie in (0, 1)")
    for name in ("sft_steps", "sft_batch", "rollouts", "new_tokens"):
      if getattr(self, name) < (0 if name == "sft_steps" else 1):
        raise ValueError(f"StudyConfig.{name}={getattr(self, name)} is too small")
    if self.fp4_sites not in SITE_SCOPES:
      raise ValueError(f"StudyConfig.fp4_sites={self.fp4_sites!r}; use one of {SITE_SCOPES}")
    if self.compute_dtype not in ("bfloat16", "float32"):
      raise ValueError(f"StudyConfig.compute_dtype={self.compute_dtype!r}; use bfloat16 or float32")


def _sft(policy, task, tokenizer, config: StudyConfig, progress: bool) -> list[float]:
  pairs = data.demonstration_pairs(task, tokenizer, config.seed, 8)
  length = max(len(p) + len(c) for p, c in pairs) + 16
  length = round_up(length, 16)

  def batches(step):
    pairs = data.demonstration_pairs(
      task, tokenizer, config.seed * 100_003 + step, config.sft_batch
    )
    return sft_batch(pairs, length, tokenizer.pad_id)

  return train_sft(
    policy, batches, steps=config.sft_steps, learning_rate=config.sft_lr, progress=progress
  )


def _rollout_config(config: StudyConfig, tokenizer, **kwargs) -> RolloutConfig:
  sampling = SamplingConfig(
    temperature=config.temperature,
    max_new_tokens=config.new_tokens,
    stop_tokens=(tokenizer.eos_id,),
  )
  return RolloutConfig(
    compute_dtype=config.compute_dtype,
    max_len=16 * 8 + config.new_tokens,
    prompt_bucket=16,
    sampling=sampling,
    **kwargs,
  )


def run_study(config: StudyConfig, *, progress: bool = True) -> dict:
  """Run the study; returns a JSON-ready dict (see experiments/mismatch.py)."""
  start = time.time()
  task = get_task(config.task)
  tokenizer = CharTokenizer()
  cfg = get_preset(
    config.preset, vocab_size=max(get_preset(config.preset).vocab_size, tokenizer.vocab_size)
  )
  policy = Transformer(cfg, rngs=nnx.Rngs(config.seed))
  sft_losses = _sft(policy, task, tokenizer, config, progress)

  items = task.sample(config.seed + 10_000, config.rollouts)
  prompts = [data.prompt_ids(tokenizer, item) for item in items]
  key = jax.random.key(config.seed)
  fp4_engine = RolloutEngine(
    policy,
    _rollout_config(
      config,
      tokenizer,
      precision="fp4",
      fmt=config.fmt,
      fp4_sites=config.fp4_sites,
      guidance="full",
      guided_layers="all",
      kernels=config.kernels,
    ),
    capture_inputs=True,
  )  # the sparse records are derived from them
  fp4_rollout = fp4_engine.generate(prompts, key)
  bf16_engine = RolloutEngine(
    policy, _rollout_config(config, tokenizer, precision="bf16", guidance="none")
  )
  bf16_rollout = bf16_engine.generate(prompts, key)
  full = fp4_rollout.guidance
  compact = full.to_compact()
  half = resolve_layers("last_half", cfg.num_layers)
  dtype = jnp.dtype(config.compute_dtype)

  forward = nnx.jit(
    lambda m, r, g, quant, replay: training_forward(
      m,
      r.tokens,
      r.positions,
      r.mask,
      guidance=g,
      routing_replay=replay,
      temperature=config.temperature,
      quant=call_config(quant, compute_dtype=dtype, recording=Recording(form="full")),
    ),
    static_argnums=(3, 4),
  )
  forward_inputs = nnx.jit(
    lambda m, r, g, quant, replay: training_forward(
      m,
      r.tokens,
      r.positions,
      r.mask,
      guidance=g,
      routing_replay=replay,
      temperature=config.temperature,
      quant=call_config(quant, compute_dtype=dtype, recording=Recording(form="full", inputs=True)),
    ),
    static_argnums=(3, 4),
  )

  def measure(rollout, quant, guidance, replay, inputs=False):
    logp, out = (forward_inputs if inputs else forward)(
      policy, rollout.without_cache(), guidance, quant, replay
    )
    m = mismatch_metrics(rollout.logprobs, logp, rollout.response_mask)
    row = {name: m[f"mismatch/{name}"] for name in REPORTED}
    row.update(
      {k: m[k] for k in ("is_ratio/mean", "is_ratio/max", "is_ratio/min", "tis/clip_frac")}
    )
    if quant is not None:
      d = fp4_disagreement(full.sites, out.sites, rollout.mask)
      row.update(
        {
          k: d[k]
          for k in (
            "code_disagree_frac",
            "one_step_frac",
            "mantissa_disagree_frac",
            "scale_disagree_frac",
          )
        }
      )
      row["per_layer"] = d["per_layer"]
      row.update(guidance_agreement(out.fallbacks, rollout.mask))
      if inputs:  # for the calibration of sparse guidance's margins
        row["_train"] = (out.sites, out.site_inputs)
    else:  # nothing is quantized on either path
      row.update(code_disagree_frac=None, one_step_frac=None)
    return row

  nearest = QuantConfig(fmt=config.fmt, sites=config.fp4_sites)
  guided = lambda layers: nearest.replace(rounding="guided", guided_layers=layers)  # noqa: E731
  modes = {
    "bf16": measure(bf16_rollout, None, None, False),
    "none": measure(fp4_rollout, nearest, None, False),
    "none+replay": measure(fp4_rollout, nearest, full.select_layers(()), True, inputs=True),
    "compact": measure(fp4_rollout, guided("last_half"), compact.select_layers(half), True),
    "full": measure(fp4_rollout, guided("all"), full, True, inputs=True),
  }
  mask = np.asarray(fp4_rollout.mask)
  rollout_inputs = fp4_rollout.site_inputs
  calibration = {
    state: sparse_study.calibrate(
      full.sites, rollout_inputs, *modes[mode].pop("_train"), mask, config.delta_quantile
    )
    for state, mode in (("full_guidance", "full"), ("nearest_replay", "none+replay"))
  }
  spec = fp4.SparseSpec(delta=config.delta)
  sparse_measure = lambda g: measure(fp4_rollout, guided("all"), g, True)  # noqa: E731
  deltas = sorted(set(config.delta_sweep) | {config.delta})
  # Per-site-kind margins from this run's calibration (the paths differ at some sites only).
  site_specs = [
    (
      spec.replace(site_deltas=sparse_study.site_deltas(calibration["full_guidance"], q)),
      {"site_quantile": q},
    )
    for q in (0.99, 0.999, 0.9999)
  ]
  sparse_sweep = sparse_study.sparse_rows(
    full, rollout_inputs, deltas, spec, mask, sparse_measure, site_specs
  )
  modes["sparse"] = next(
    r for r in sparse_sweep if r["delta"] == config.delta and not r["site_deltas"]
  )
  sweep = []
  for n in range(cfg.num_layers + 1) if config.layer_sweep else ():
    layers = resolve_layers(n, cfg.num_layers)
    for mode, guidance in (("compact", compact), ("full", full)):
      row = measure(fp4_rollout, guided(n), guidance.select_layers(layers), True)
      sweep.append(
        {
          "mode": mode,
          "guided_layers": n,
          **{
            k: row[k]
            for k in ("k3_kl", "kl", "logp_abs_diff", "prob_diff_max", "code_disagree_frac")
          },
          "bytes_per_token": guidance.select_layers(layers).bytes_per_token(),
        }
      )

  bytes_per_token = {
    "compact": compact.select_layers(half).bytes_per_token(),
    "full": full.bytes_per_token(),
    "sparse": modes["sparse"]["bytes_per_token"],
  }
  texts = data.decode_responses(tokenizer, fp4_rollout.responses())
  rewards = [task.score(item, text) for item, text in zip(items, texts)]
  k3 = {m: modes[m]["k3_kl"] for m in MODES}
  # Guidance against nearest rounding *with* routing replay, so that it is not credited with
  # what replay removes ("replay_k3_reduction" shows that part on its own).
  targets = {
    "full_k3_reduction": k3["none+replay"] / max(k3["full"], 1e-30),
    "compact_k3_reduction": k3["none+replay"] / max(k3["compact"], 1e-30),
    "replay_k3_reduction": k3["none"] / max(k3["none+replay"], 1e-30),
    "bytes_ratio_full_over_compact": bytes_per_token["full"] / bytes_per_token["compact"],
  }
  targets["met"] = {
    "full_10x": targets["full_k3_reduction"] >= 10,
    "compact_2x": targets["compact_k3_reduction"] >= 2,
    "bytes_5.5x": targets["bytes_ratio_full_over_compact"] >= 5.5,
  }
  targets["sparse"] = sparse_targets(k3["compact"], sparse_sweep, bytes_per_token)
  geometry = {}
  if config.geometries:
    costs = modes["sparse"]["costs"]
    best = targets["sparse"]["within_1.5x"]
    geometry = {
      name: {
        scope: sparse_study.geometry_bytes(name, scope, costs, config.fmt) for scope in SITE_SCOPES
      }
      for name in sparse_study.GEOMETRIES
    }
    if best:  # the cheapest sparse row within 1.5x of compact's k3, at the same geometries
      for name in sparse_study.GEOMETRIES:
        for scope in SITE_SCOPES:
          geometry[name][scope]["sparse_within_1.5x"] = sparse_study.geometry_bytes(
            name, scope, best["costs"], config.fmt
          )["sparse"]
  return {
    "config": dataclasses.asdict(config),
    "model": {"preset": cfg.name, "layers": cfg.num_layers, "guided_half": list(half)},
    "compute_dtype": {
      "rollout": f"{config.compute_dtype} activations, one-token decode steps over the KV "
      "cache (FP4 weights dequantized on the fly, FP4 KV cache)",
      "training": f"{config.compute_dtype} activations, whole-sequence prefill from float32 "
      "master weights fake-quantized to FP4",
      "high_precision": "router, norms (float32 inside), attention softmax and LM head in float32",
    },
    "modes": modes,
    "bytes_per_token": bytes_per_token,
    "qwen3_30b_a3b_bytes_per_token": scope_bytes(config.fmt),
    "sweep": sweep,
    "sparse_sweep": sparse_sweep,
    "sparse_calibration": calibration,
    "sparse_geometry_bytes_per_token": geometry,
    "targets": targets,
    "sft": {
      "steps": config.sft_steps,
      "first_nll": sft_losses[0] if sft_losses else None,
      "final_nll": float(np.mean(sft_losses[-10:])) if sft_losses else None,
    },
    "rollout": {
      "sequences": config.rollouts,
      "response_tokens": int(np.asarray(fp4_rollout.response_mask).sum()),
      "fp4_reward_mean": float(np.mean(rewards)),
    },
    "kernels": {"rollout": fp4_engine.kernels, "fallback_reason": fp4_engine.kernels_fallback},
    "seconds": time.time() - start,
  }


def sparse_targets(compact_k3: float, sparse_sweep: list, bytes_per_token: dict) -> dict:
  """Issue 16's target: the cheapest sparse row whose k3 is within 1.5x of compact's, and
  its bytes against full guidance over the same (every) layer and against compact."""
  within = [r for r in sparse_sweep if r["k3_kl"] <= 1.5 * compact_k3]
  out = {"compact_k3": compact_k3, "within_1.5x": None}
  if within:
    best = min(within, key=lambda r: r["bytes_per_token"])
    out["within_1.5x"] = {
      "delta": best["delta"],
      "k3_kl": best["k3_kl"],
      "bytes_per_token": best["bytes_per_token"],
      "full_over_sparse": bytes_per_token["full"] / best["bytes_per_token"],
      "compact_over_sparse": bytes_per_token["compact"] / best["bytes_per_token"],
      "site_deltas": best.get("site_deltas", {}),
      "costs": best["costs"],
    }
    out["met"] = {
      "full_20x": out["within_1.5x"]["full_over_sparse"] >= 20,
      "compact_3x": out["within_1.5x"]["compact_over_sparse"] >= 3,
    }
  return out


def scope_bytes(fmt: str = "nvfp4") -> dict:
  """Guidance bytes per token at the Qwen3-30B-A3B geometry, by FP4 scope and mode (compact
  on the deeper half, full on all layers, both with routing), from shapes alone."""
  cfg = qwen3_30b_a3b()
  out = {}
  for sites in SITE_SCOPES:
    base = RolloutConfig(precision="fp4", fmt=fmt, fp4_sites=sites)
    out[sites] = {
      "compact": guidance_bytes_per_token(
        cfg, base.replace(guidance="compact", guided_layers="last_half")
      ),
      "full": guidance_bytes_per_token(cfg, base.replace(guidance="full", guided_layers="all")),
    }
  return out
