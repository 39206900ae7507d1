"""Where plain FP4 QAT's mismatch is largest, before any RL: a map over answer length, depth
and the engine difference, of four training paths against their FP4 rollout.

A point is (chain terms, layers, rollout skew, router dtype). For each point:
1. a warm start: a `preset` policy at that depth, SFT-trained on `chain` with that many
   terms (one per (terms, layers), shared by the point's engine settings, which act on the
   rollout only);
2. one FP4 rollout of `rollouts` held-out problems (temperature 1), capturing full guidance
   and the experts of every layer, with the point's engine difference (`rollout_skew`:
   every layer's output times 1 + s * u; `router_dtype="compute"`: the rollout's router in
   bf16 while training's is float32);
3. the training path over those tokens, four ways (the arms' training paths): `fp4-qat`
   (nearest, its own experts), `fp4-qat-r3` (nearest, the rollout's experts), `trace`
   (compact guidance at the deeper half, replay) and `trace-full` (full guidance at every
   layer, replay). Guidance capture does not change the rollout's numbers, so one rollout
   is every path's own;
4. per path, on the response tokens: k3 mean and p99, the extreme-token share (r > 2 or
   < 1/2), the sequence log-ratio |sum log r| mean and p90, the router flip rate per layer
   (the share of real tokens whose router picks another expert set than the rollout's; on
   a replaying path, the set it would have picked: replay uses the rollout's) and the code
   disagreement per layer (`rl.metrics.fp4_disagreement`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from trace_jax.model.config import get_preset
from trace_jax.model.quant import ROUTER_DTYPES, QuantConfig, resolve_layers
from trace_jax.model.skew import check_amount
from trace_jax.model.transformer import Transformer
from trace_jax.rl import data
from trace_jax.rl.metrics import fp4_disagreement, mismatch_metrics, router_flip_rate
from trace_jax.model.config import COMPUTE_DTYPES
from trace_jax.rollout.config import RolloutConfig, SamplingConfig
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.rollout.trajectories import FINISH_STOP
from trace_jax.studies.mismatch import study_sft, training_path
from trace_jax.tasks.registry import get_task
from trace_jax.tasks.tokenizer import CharTokenizer
from trace_jax.utils import round_up
from trace_jax.utils.flags import knob

PATHS = ("fp4-qat", "fp4-qat-r3", "trace", "trace-full")
METRICS = (
  "k3_mean",
  "k3_p99",
  "extreme_share",
  "seq_logratio_mean",
  "seq_logratio_p90",
  "router_flip_rate",
  "code_disagreement",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MapConfig:
  """What every point shares (experiments/mismatch_map.py's flags)."""

  preset: str = knob("small", "Model preset; a point sets its depth.")
  seed: int = knob(0, "Seed of the warm start's init and data, and of the rollouts.")
  sft_steps: int = knob(200, "SFT warm-start steps per (terms, layers).")
  sft_batch: int = knob(32, "Warm-start demonstrations per step.")
  sft_lr: float = knob(3e-3, "Warm-start learning rate.")
  rollouts: int = knob(64, "Sequences in each point's rollout.")
  temperature: float = knob(1.0, "Sampling temperature.")
  compute_dtype: str = knob("bfloat16", "Activations' dtype of both paths.", choices=COMPUTE_DTYPES)
  kernels: str = knob("xla", "The FP4 rollout's implementation: auto, pallas or xla.")

  def __post_init__(self):
    for name in ("sft_batch", "rollouts"):
      if getattr(self, name) < 1:
        raise ValueError(f"MapConfig.{name}={getattr(self, name)} must be >= 1")
    if self.sft_steps < 0:
      raise ValueError(f"MapConfig.sft_steps={self.sft_steps} must be >= 0")
    if not self.temperature > 0:
      raise ValueError(f"MapConfig.temperature={self.temperature} must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MapPoint:
  """One point of the map."""

  terms: int  # chain terms: the answer's length (about 7 tokens a term)
  layers: int
  rollout_skew: float = 0.0
  router_dtype: str = "float32"  # the rollout's router: "float32" or "compute"

  def __post_init__(self):
    if not isinstance(self.terms, int) or self.terms < 2:
      raise ValueError(f"MapPoint.terms={self.terms!r} must be an int >= 2")
    if not isinstance(self.layers, int) or self.layers < 1:
      raise ValueError(f"MapPoint.layers={self.layers!r} must be an int >= 1")
    check_amount(self.rollout_skew, "MapPoint.rollout_skew")
    if self.router_dtype not in ROUTER_DTYPES:
      raise ValueError(
        f"MapPoint.router_dtype={self.router_dtype!r} is not allowed; use one of {ROUTER_DTYPES}"
      )

  @property
  def key(self) -> tuple:
    return (self.terms, self.layers, float(self.rollout_skew), self.router_dtype)

  def to_json(self) -> dict:
    return dict(
      terms=self.terms,
      layers=self.layers,
      rollout_skew=float(self.rollout_skew),
      router_dtype=self.router_dtype,
    )


def default_points(
  terms=(4, 8, 16, 32), layers=(4, 8, 16), base_terms=8, base_layers=4, skew=2.0**-4
) -> list[MapPoint]:
  """The map: every length at the base depth and every depth at the base length, each on
  three engines (the same kernels; a skew of `skew`; the rollout's router in bf16)."""
  engines = ((0.0, "float32"), (skew, "float32"), (0.0, "compute"))
  cells = [(t, base_layers) for t in terms] + [(base_terms, n) for n in layers if n != base_layers]
  return [
    MapPoint(terms=t, layers=n, rollout_skew=s, router_dtype=r)
    for t, n in cells
    for s, r in engines
  ]


def warm_start(config: MapConfig, terms: int, layers: int, *, progress: bool = True):
  """(policy, SFT losses): a `config.preset` policy of `layers` layers SFT-trained on
  `chain` with `terms` terms."""
  task, tokenizer = get_task("chain", terms=terms), CharTokenizer()
  vocab = max(get_preset(config.preset).vocab_size, tokenizer.vocab_size)
  cfg = get_preset(config.preset, num_layers=layers, vocab_size=vocab)
  policy = Transformer(cfg, rngs=nnx.Rngs(config.seed))
  losses = study_sft(
    policy,
    task,
    tokenizer,
    steps=config.sft_steps,
    batch=config.sft_batch,
    seed=config.seed,
    learning_rate=config.sft_lr,
    progress=progress,
    demos=16,
  )
  return policy, losses


def answer_budget(task, tokenizer, seed: int) -> int:
  """New tokens per sequence: the longest of 32 demonstrations' completions, plus 16."""
  pairs = data.demonstration_pairs(task, tokenizer, seed + 20_000, 32)
  return max(len(c) for _, c in pairs) + 16


def path_metrics(rollout, logp, out, full_sites, mask) -> dict:
  """The point's metrics of one training path (see the module docstring)."""
  m = mismatch_metrics(rollout.logprobs, logp, rollout.response_mask)
  flips = [float(x) for x in router_flip_rate(rollout.guidance.routing, out.router_choice, mask)]
  per_layer = fp4_disagreement(full_sites, out.sites, mask)["per_layer"]
  codes = [per_layer[layer]["code_disagree_frac"] for layer in sorted(per_layer)]
  return dict(
    k3_mean=m["mismatch/k3_kl"],
    k3_p99=m["mismatch/k3_p99"],
    extreme_share=m["mismatch/extreme_frac"],
    seq_logratio_mean=m["mismatch/seq_logratio_mean"],
    seq_logratio_p90=m["mismatch/seq_logratio_p90"],
    router_flip_rate=flips,
    router_flip_rate_mean=float(np.mean(flips)),
    code_disagreement=codes,
    code_disagreement_mean=float(np.mean(codes)),
  )


def measure_point(config: MapConfig, point: MapPoint, policy) -> dict:
  """One point's rollout and its four training paths, from `policy` (the point's warm
  start): the JSON row `results.json` holds."""
  start = time.time()
  task, tokenizer = get_task("chain", terms=point.terms), CharTokenizer()
  items = task.sample(config.seed + 10_000, config.rollouts, split="eval")
  prompts = [data.prompt_ids(tokenizer, item) for item in items]
  new_tokens = answer_budget(task, tokenizer, config.seed)
  rollout_config = RolloutConfig(
    precision="fp4",
    compute_dtype=config.compute_dtype,
    max_len=round_up(max(map(len, prompts)), 16) + new_tokens,
    prompt_bucket=16,
    sampling=SamplingConfig(
      temperature=config.temperature, max_new_tokens=new_tokens, stop_tokens=(tokenizer.eos_id,)
    ),
    guidance="full",
    guided_layers="all",
    record_routing=True,
    kernels=config.kernels,
    skew=point.rollout_skew,
    router_dtype=point.router_dtype,
  )
  engine = RolloutEngine(policy, rollout_config)
  key = jax.random.key(config.seed)
  rollout = engine.generate(prompts, key, version=0, sequences=range(len(prompts)))
  full = rollout.guidance
  compact = full.to_compact()
  layers = policy.cfg.num_layers
  half = resolve_layers("last_half", layers)
  nearest = QuantConfig()
  guided = lambda spec: nearest.replace(rounding="guided", guided_layers=spec)  # noqa: E731
  ways = {
    "fp4-qat": (nearest, None, False),
    "fp4-qat-r3": (nearest, full.select_layers(()), True),
    "trace": (guided("last_half"), compact.select_layers(half), True),
    "trace-full": (guided("all"), full, True),
  }
  mask = np.asarray(rollout.mask)
  paths = {}
  for name, (quant, guidance, replay) in ways.items():
    logp, out = training_path(
      policy,
      rollout.without_cache(),
      guidance,
      quant=quant,
      compute_dtype=config.compute_dtype,
      replay=replay,
      temperature=config.temperature,
      inputs=False,
    )
    paths[name] = path_metrics(rollout, logp, out, full.sites, mask)
  texts = data.decode_responses(tokenizer, rollout.responses())
  rewards = [task.score(item, text) for item, text in zip(items, texts)]
  response = np.asarray(rollout.response_mask)
  return dict(
    point.to_json(),
    answer_tokens=float(response.sum(1).mean()),
    answer_budget=new_tokens,
    reward_fp4=float(np.mean(rewards)),
    stopped_share=float(np.mean(np.asarray(rollout.finish) == FINISH_STOP)),
    rollouts=config.rollouts,
    paths=paths,
    seconds=round(time.time() - start, 1),
  )
