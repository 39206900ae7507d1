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
   the default `delta`, with replay; `studies.sparse`). Guidance is judged against
   "none+replay", so it is not credited with what replay removes.
4. Sparse guidance: calibrate `delta` from the measured |t_train - t_rollout| per site, sweep
   `delta` (k3, code disagreement, bytes/token, densities, overflow), and scale the measured
   per-element costs to the Qwen3-30B-A3B and Qwen3.5-35B-A3B geometries.

Each step is a small function over typed values (`Measurement`, `sparse.SparseRow`,
`LayerRow`, `Targets`, the `MismatchStudy` they make up: `studies.mismatch_results`);
`MismatchStudy.to_json()` is the JSON experiments/mismatch.py writes.

By default no noise is injected anywhere: the paths differ only as real systems do (decode
vs prefill shapes and reduction orders, bf16 rounding, XLA's fusion of the rollout's step).
`rollout_skew` > 0 makes both rollouts (FP4 and bf16) an engine that computes differently
from the trainer by a controlled amount (`model.skew`: every layer's output times
1 + skew * u); the training path is never skewed, so every mode measures against it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from trace_jax import fp4 as fp4_lib
from trace_jax.kernels import check_mode as check_kernels
from trace_jax.model.config import get_preset, qwen3_30b_a3b
from trace_jax.model.skew import check_amount
from trace_jax.model.quant import (
  PATH_FIELDS,
  SITE_SCOPES,
  CallOptions,
  QuantConfig,
  Recording,
  check_run_scheme,
  resolve_layers,
)
from trace_jax.model.transformer import Transformer
from trace_jax.rl import data
from trace_jax.studies import sparse as sparse_study
from trace_jax.studies.mismatch_results import (
  LayerRow,
  Measurement,
  MismatchStudy,
  SparseTarget,
  Targets,
)
from trace_jax.rl.metrics import fp4_disagreement, guidance_agreement, mismatch_metrics
from trace_jax.rollout.accounting import guidance_bytes_per_token
from trace_jax.model.config import COMPUTE_DTYPES
from trace_jax.rollout.config import RolloutConfig, SamplingConfig
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.run.warmstart import run_sft
from trace_jax.tasks.registry import get_task
from trace_jax.tasks.tokenizer import CharTokenizer
from trace_jax.training.forward import training_forward
from trace_jax.utils import flags, round_up
from trace_jax.utils.flags import knob

MODES = ("bf16", "none", "none+replay", "compact", "full", "sparse")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyConfig:
  """The study's knobs (experiments/mismatch.py's flags)."""

  preset: str = knob("small", "Model preset.")
  task: str = knob("arith", "Built-in task for the warm start and prompts.")
  seed: int = knob(0, "Seed of the SFT data, init and rollouts.")
  sft_steps: int = knob(300, "SFT warm-start steps.")
  sft_batch: int = knob(32, "Warm-start demonstrations per step.")
  sft_lr: float = knob(3e-3, "Warm-start learning rate.")
  rollouts: int = knob(64, "Sequences in the studied batch.")
  new_tokens: int = knob(48, "Max generated tokens per sequence.")
  temperature: float = knob(1.0, "Sampling temperature.")
  compute_dtype: str = knob(
    "bfloat16", "Activation dtype of both paths, as in production.", choices=COMPUTE_DTYPES
  )
  fp4: QuantConfig = QuantConfig()
  kernels: str = knob("auto", "The FP4 rollout's implementation: auto, pallas or xla.")
  scan_layers: bool = knob(
    True, "Training path's alike layers under one scan (off: unrolled; last bits may differ)."
  )
  rollout_skew: float = knob(
    0.0,
    "Both rollouts scale each layer's output by 1 + s * u, u in (-1, 1) hashed from "
    "(version 0, sequence, position, layer, element); the training path never. 0: none.",
  )
  delta: float = knob(
    fp4_lib.DEFAULT_DELTA,
    "Sparse guidance: margin around an E2M1 midpoint (grid units); modes['sparse'] is "
    "measured at it.",
  )
  delta_sweep: tuple = knob(
    (0.0, 0.005, 0.01, 0.02, 0.035, 0.05, 0.1, 0.15),
    "Sparse guidance: the deltas of the sweep.",
    parse=flags.parse_floats,
  )
  delta_quantile: float = knob(0.999, "Share of |t_train - t_rollout| the calibrated delta covers.")
  geometries: bool = knob(
    True, "Sparse bytes at the Qwen3-30B-A3B and Qwen3.5-35B-A3B geometries (eval_shape traces)."
  )
  layer_sweep: bool = knob(
    True, "Compact / full by number of guided layers (one training-path compile each)."
  )

  def __post_init__(self):
    check_kernels(self.kernels, "StudyConfig.kernels")
    check_run_scheme(self.fp4, "StudyConfig.fp4")
    check_amount(self.rollout_skew, "StudyConfig.rollout_skew")
    object.__setattr__(self, "delta_sweep", tuple(float(d) for d in self.delta_sweep))
    for d in (self.delta, *self.delta_sweep):
      fp4_lib.SparseSpec(delta=d)  # a ValueError naming delta and its range
    if not 0 < self.delta_quantile < 1:
      raise ValueError(f"StudyConfig.delta_quantile={self.delta_quantile} must lie in (0, 1)")
    for name in ("sft_steps", "sft_batch", "rollouts", "new_tokens"):
      if getattr(self, name) < (0 if name == "sft_steps" else 1):
        raise ValueError(f"StudyConfig.{name}={getattr(self, name)} is too small")
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"StudyConfig.compute_dtype={self.compute_dtype!r}; use bfloat16 or float32")

  def to_json(self) -> dict:
    """By flat name, as the study's JSON always held it (`activations` only when not W4A4,
    `kv_precision` only when not FP4, `rollout_skew` only when not 0, `scan_layers` only when
    off; the scheme's per-path
    fields, at their defaults here (`check_run_scheme`), not at all)."""
    out = flags.to_flat(self)
    for field in PATH_FIELDS:
      del out[flags.flat_name(QuantConfig.__dataclass_fields__[field])]
    for name in ("activations", "kv_precision"):
      if out[name] == "fp4":
        del out[name]
    if not out["rollout_skew"]:
      del out["rollout_skew"]
    if out["scan_layers"]:
      del out["scan_layers"]
    return out


def study_sft(
  policy, task, tokenizer, *, steps, batch, seed, learning_rate, progress, demos, step_seed=None
) -> list[float]:
  """A study's SFT warm start (`run.warmstart.run_sft`) on its own demonstrations: rows as
  long as the longest of `demos` drawn from the seed, plus 16."""
  pairs = data.demonstration_pairs(task, tokenizer, seed, demos)
  length = round_up(max(len(p) + len(c) for p, c in pairs) + 16, 16)
  return run_sft(
    policy,
    task,
    tokenizer,
    steps=steps,
    batch=batch,
    seed=seed,
    learning_rate=learning_rate,
    progress=progress,
    length=length,
    step_seed=step_seed,
  )


def _sft(policy, task, tokenizer, config: StudyConfig, progress: bool) -> list[float]:
  """This study's warm start: rows from 8 demonstrations, step `s` drawn from seed
  `100003 * seed + s` (the study's draw since its first results, so they stay comparable)."""
  return study_sft(
    policy,
    task,
    tokenizer,
    steps=config.sft_steps,
    batch=config.sft_batch,
    seed=config.seed,
    learning_rate=config.sft_lr,
    progress=progress,
    demos=8,
    step_seed=lambda step: config.seed * 100_003 + step,
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
    skew=config.rollout_skew,
    **kwargs,
  )


@dataclasses.dataclass(frozen=True)
class _Rollouts:
  """The studied batch: an FP4 rollout capturing full guidance (and every site's input) on
  every layer, and a bf16 rollout of the same prompts and keys."""

  fp4: Any  # rollout.engine.Rollout
  bf16: Any
  kernels: tuple[str, str | None]

  @property
  def full(self):
    return self.fp4.guidance


def _roll_out(config: StudyConfig, policy, tokenizer, prompts) -> _Rollouts:
  """The batch; a skew (`rollout_skew`) hashes version 0 (the warm start, the study's one
  policy version) and each row's index."""
  key = jax.random.key(config.seed)
  ids = dict(version=0, sequences=range(len(prompts)))
  fp4_engine = RolloutEngine(
    policy,
    _rollout_config(
      config,
      tokenizer,
      precision="fp4",
      fp4=config.fp4,
      guidance="full",
      guided_layers="all",
      kernels=config.kernels,
    ),
    capture_inputs=True,
  )  # the sparse records are derived from them
  fp4_rollout = fp4_engine.generate(prompts, key, **ids)
  bf16_config = _rollout_config(config, tokenizer, precision="bf16", guidance="none")
  bf16_rollout = RolloutEngine(policy, bf16_config).generate(prompts, key, **ids)
  return _Rollouts(fp4_rollout, bf16_rollout, (fp4_engine.kernels, fp4_engine.kernels_fallback))


@functools.partial(
  nnx.jit, static_argnames=("quant", "compute_dtype", "replay", "temperature", "inputs")
)
def training_path(policy, rollout, guidance, *, quant, compute_dtype, replay, temperature, inputs):
  """The training path's log-probs of the rollout's tokens, every site recorded in full
  (and its input, with `inputs`)."""
  return training_forward(
    policy,
    rollout.tokens,
    rollout.positions,
    rollout.mask,
    guidance=guidance,
    routing_replay=replay,
    temperature=temperature,
    quant=quant,
    options=CallOptions(
      recording=Recording(form="full", inputs=inputs), compute_dtype=compute_dtype
    ),
  )


def measure(
  config: StudyConfig, policy, rollout, full_sites, quant, guidance, replay, inputs=False
) -> tuple[Measurement, tuple | None]:
  """The training path under `quant` (None: bf16) against `rollout`, and with `inputs`
  its (site records, site inputs) for the calibration of sparse guidance's margins."""
  logp, out = training_path(
    policy,
    rollout.without_cache(),
    guidance,
    quant=quant,
    compute_dtype=config.compute_dtype,
    replay=replay,
    temperature=config.temperature,
    inputs=inputs,
  )
  mismatch = mismatch_metrics(rollout.logprobs, logp, rollout.response_mask)
  if quant is None:  # nothing is quantized on either path
    return Measurement.of(mismatch, None, {}), None
  disagreement = fp4_disagreement(full_sites, out.sites, rollout.mask)
  agreement = guidance_agreement(out.fallbacks, rollout.mask)
  records = (out.sites, out.site_inputs) if inputs else None
  return Measurement.of(mismatch, disagreement, agreement), records


def sparse_targets(
  compact_k3: float, sparse_sweep: list[sparse_study.SparseRow], bytes_per_token: dict
) -> SparseTarget:
  """The cheapest sparse row whose k3 is within 1.5x of compact's, and its bytes against
  full guidance over the same (every) layer and against compact."""
  within = [r for r in sparse_sweep if r.k3_kl <= 1.5 * compact_k3]
  if not within:
    return SparseTarget(compact_k3=compact_k3, best=None)
  best = min(within, key=lambda r: r.bytes_per_token)
  return SparseTarget(
    compact_k3=compact_k3,
    best=best,
    full_over_sparse=bytes_per_token["full"] / best.bytes_per_token,
    compact_over_sparse=bytes_per_token["compact"] / best.bytes_per_token,
  )


def targets(modes: dict, bytes_per_token: dict, sparse_sweep: list) -> Targets:
  """The study's headline ratios from the modes' k3 and the guidance bytes (the script that
  runs the study states its targets against them)."""
  k3 = {m: modes[m].k3_kl for m in MODES}
  return Targets(
    full_k3_reduction=k3["none+replay"] / max(k3["full"], 1e-30),
    compact_k3_reduction=k3["none+replay"] / max(k3["compact"], 1e-30),
    replay_k3_reduction=k3["none"] / max(k3["none+replay"], 1e-30),
    bytes_ratio_full_over_compact=bytes_per_token["full"] / bytes_per_token["compact"],
    sparse=sparse_targets(k3["compact"], sparse_sweep, bytes_per_token),
  )


def geometry_bytes(costs: dict, best: sparse_study.SparseRow | None, fmt: str) -> dict:
  """{geometry: {scope: GeometryBytes}} at the measured sparse costs, and at the best row's
  (the cheapest within 1.5x of compact's k3) where there is one."""
  out = {}
  for name in sparse_study.GEOMETRIES:
    out[name] = {}
    for scope in SITE_SCOPES:
      row = sparse_study.geometry_bytes(name, scope, costs, fmt)
      if best is not None:
        within = sparse_study.geometry_bytes(name, scope, best.costs, fmt).sparse
        row = dataclasses.replace(row, sparse_within=within)
      out[name][scope] = row
  return out


# The StudyConfig fields the SFT warm start depends on; the others act only after it.
WARM_START_FIELDS = ("preset", "task", "seed", "sft_steps", "sft_batch", "sft_lr")


@dataclasses.dataclass(frozen=True)
class WarmStart:
  """A policy after the study's SFT warm start (`warm_start`), which `run_study` can reuse
  for every config with the same `WARM_START_FIELDS` (e.g. across rollout skews): the study
  only reads the policy after it."""

  policy: Any  # model.transformer.Transformer
  sft_losses: tuple[float, ...]
  settings: dict  # {field: value} of WARM_START_FIELDS


def _warm_settings(config: StudyConfig) -> dict:
  return {name: getattr(config, name) for name in WARM_START_FIELDS}


def _model_config(config: StudyConfig, tokenizer):
  vocab_size = max(get_preset(config.preset).vocab_size, tokenizer.vocab_size)
  return get_preset(config.preset, vocab_size=vocab_size, scan_layers=config.scan_layers)


def warm_start(config: StudyConfig, *, progress: bool = True) -> WarmStart:
  """The study's policy: initialised from `config.seed` and SFT-trained (`_sft`)."""
  task, tokenizer = get_task(config.task), CharTokenizer()
  policy = Transformer(_model_config(config, tokenizer), rngs=nnx.Rngs(config.seed))
  sft_losses = _sft(policy, task, tokenizer, config, progress)
  return WarmStart(policy, tuple(sft_losses), _warm_settings(config))


def run_study(
  config: StudyConfig, *, progress: bool = True, warm: WarmStart | None = None
) -> MismatchStudy:
  """Run the study (see the module docstring); from `warm` (a `warm_start` of a config with
  the same `WARM_START_FIELDS`) instead of a fresh warm start when given. `seconds` is this
  call's time (with a `warm` passed in, the warm start's is not in it).

  Raises:
    ValueError: `warm` was made for other warm-start settings.
  """
  start = time.time()
  if warm is not None and warm.settings != _warm_settings(config):
    raise ValueError(
      f"run_study: warm start made for {warm.settings}, the config asks for "
      f"{_warm_settings(config)}; pass a warm start with the same {WARM_START_FIELDS}"
    )
  warm = warm_start(config, progress=progress) if warm is None else warm
  task, tokenizer = get_task(config.task), CharTokenizer()
  cfg = _model_config(config, tokenizer)
  policy, sft_losses = warm.policy, warm.sft_losses
  items = task.sample(config.seed + 10_000, config.rollouts)
  rollouts = _roll_out(config, policy, tokenizer, [data.prompt_ids(tokenizer, i) for i in items])
  fp4_rollout, full = rollouts.fp4, rollouts.full
  compact, half = full.to_compact(), resolve_layers("last_half", cfg.num_layers)
  path = functools.partial(measure, config, policy, fp4_rollout, full.sites)
  nearest = config.fp4
  guided = lambda layers: nearest.replace(rounding="guided", guided_layers=layers)  # noqa: E731

  modes, records = {}, {}
  modes["bf16"], _ = measure(config, policy, rollouts.bf16, full.sites, None, None, False)
  modes["none"], _ = path(nearest, None, False)
  modes["none+replay"], records["nearest_replay"] = path(
    nearest, full.select_layers(()), True, inputs=True
  )
  modes["compact"], _ = path(guided("last_half"), compact.select_layers(half), True)
  modes["full"], records["full_guidance"] = path(guided("all"), full, True, inputs=True)

  mask = np.asarray(fp4_rollout.mask)
  inputs = fp4_rollout.site_inputs
  calibration = {
    state: sparse_study.calibrate(full.sites, inputs, *records[state], mask, config.delta_quantile)
    for state in ("full_guidance", "nearest_replay")
  }
  spec = fp4_lib.SparseSpec(delta=config.delta)
  # Per-site-kind margins from this run's calibration (the paths differ at some sites only).
  site_specs = [
    (spec.replace(site_deltas=sparse_study.site_deltas(calibration["full_guidance"], q)), q)
    for q in (0.99, 0.999, 0.9999)
  ]
  deltas = sorted(set(config.delta_sweep) | {config.delta})
  sparse_sweep = sparse_study.sparse_rows(
    full, inputs, deltas, spec, mask, lambda g: path(guided("all"), g, True)[0], site_specs
  )
  modes["sparse"] = next(r for r in sparse_sweep if r.delta == config.delta and not r.site_deltas)
  sweep = []
  for n in range(cfg.num_layers + 1) if config.layer_sweep else ():
    layers = resolve_layers(n, cfg.num_layers)
    for mode, guidance in (("compact", compact), ("full", full)):
      row, _ = path(guided(n), guidance.select_layers(layers), True)
      sweep.append(
        LayerRow(
          mode=mode,
          guided_layers=n,
          k3_kl=row.k3_kl,
          kl=row.kl,
          logp_abs_diff=row.logp_abs_diff,
          prob_diff_max=row.prob_diff_max,
          code_disagree_frac=row.code_disagree_frac,
          bytes_per_token=guidance.select_layers(layers).bytes_per_token(),
        )
      )
  bytes_per_token = {
    "compact": compact.select_layers(half).bytes_per_token(),
    "full": full.bytes_per_token(),
    "sparse": modes["sparse"].bytes_per_token,
  }
  texts = data.decode_responses(tokenizer, fp4_rollout.responses())
  rewards = [task.score(item, text) for item, text in zip(items, texts)]
  goals = targets(modes, bytes_per_token, sparse_sweep)
  geometry = {}
  if config.geometries:
    geometry = geometry_bytes(modes["sparse"].costs, goals.sparse.best, config.fp4.fmt)
  return MismatchStudy(
    config=config,
    preset=cfg.name,
    layers=cfg.num_layers,
    guided_half=half,
    modes=modes,
    bytes_per_token=bytes_per_token,
    qwen3_30b_a3b_bytes_per_token=scope_bytes(config.fp4.fmt),
    sweep=sweep,
    sparse_sweep=sparse_sweep,
    sparse_calibration=calibration,
    sparse_geometry_bytes_per_token=geometry,
    targets=goals,
    sft_nll=(
      sft_losses[0] if sft_losses else None,
      float(np.mean(sft_losses[-10:])) if sft_losses else None,
    ),
    response_tokens=int(np.asarray(fp4_rollout.response_mask).sum()),
    fp4_reward_mean=float(np.mean(rewards)),
    kernels=rollouts.kernels,
    seconds=time.time() - start,
  )


def scope_bytes(fmt: str = "nvfp4") -> dict:
  """Guidance bytes per token at the Qwen3-30B-A3B geometry, by FP4 scope and mode (compact
  on the deeper half, full on all layers, both with routing), from shapes alone."""
  cfg = qwen3_30b_a3b()
  out = {}
  for sites in SITE_SCOPES:
    base = RolloutConfig(precision="fp4", fp4=QuantConfig(fmt=fmt, sites=sites))
    out[sites] = {
      "compact": guidance_bytes_per_token(
        cfg, base.replace(guidance="compact", guided_layers="last_half")
      ),
      "full": guidance_bytes_per_token(cfg, base.replace(guidance="full", guided_layers="all")),
    }
  return out
