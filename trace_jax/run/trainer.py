"""The RL loop (DESIGN.md section 4):

  for each step:
    1. sample problems, `group_size` samples each;
    2. roll out with the arm's precision, capturing its guidance (one or more turns);
    3. keep the guidance on the device: the trainer consumes it at once;
    4. training-path log-probs of the sampled tokens = pi_old, with the arm's quantization,
       guidance and routing replay; the mismatch metrics compare them with the rollout's;
    5. minibatch GRPO updates (optax);
    6. weight sync: an engine re-quantizes the new weights (`quantize_params`) when it
       next runs, once per step per rollout precision;
  and every `eval_every` steps a greedy evaluation in FP4 and in bf16.

Everything random derives from (seed, step), and checkpoints hold the policy, optimizer,
reference policy and step, so a resumed run continues exactly as an uninterrupted one.

Faults stop the run without saving bad state: a non-finite loss, gradient norm or parameter,
or a parameter beyond `RLConfig.max_param_abs`, raises `DivergenceError` naming the step
before anything of that step is logged or saved, so the latest checkpoint stays the last
good one. A resume uses the newest checkpoint that restores and verifies (`Checkpoints`),
and cuts metrics.jsonl back to the steps that checkpoint holds, so every step's line
appears exactly once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding
from tqdm.auto import tqdm

from trace_jax.model.quant import Recording, call_config, resolve_layers
from trace_jax.model.sharding import (
  batch_sharding,
  guidance_specs,
  make_mesh,
  shard_model,
  shard_optimizer,
)
from trace_jax.rl import data
from trace_jax.rl import episodes as episodes_lib
from trace_jax.run import policy_source
from trace_jax.run import warmstart
from trace_jax.run.checkpoint import Checkpoints
from trace_jax.rl.config import RLConfig
from trace_jax.rl.grpo import group_advantages, grpo_loss
from trace_jax.rl.metrics import (
  disagreement_metrics,
  group_reward_metrics,
  guidance_agreement,
  mismatch_metrics,
)
from trace_jax.rollout.config import SamplingConfig
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.tasks.registry import get_task
from trace_jax.training.forward import token_entropy, training_forward
from trace_jax.utils import append_jsonl, read_jsonl, round_up, write_atomic
from trace_jax.utils.distributed import global_array, host_array, is_main_process
from trace_jax.utils.lock import lock_run_workdir

_STATIC = ("quant", "replay", "temperature")


@struct.dataclass
class TrainExample:
  """The trainer's unit between stages: one step's trajectories, [B, S] (minibatch rows
  taken by `jax.tree.map`). `old_logp` and `advantages` are filled in by scoring."""

  tokens: jax.Array  # int32 [B, S]
  positions: jax.Array  # int32 [B, S]
  mask: jax.Array  # bool [B, S], every real token
  response_mask: jax.Array  # bool [B, S], the tokens the loss trains
  rollout_logp: jax.Array  # float32 [B, S], log pi_rollout
  old_logp: jax.Array | None = None  # float32 [B, S], log pi_old (training path, step start)
  advantages: jax.Array | None = None  # float32 [B]


@functools.partial(nnx.jit, static_argnames=_STATIC + ("record",))
def _old_logprobs(
  policy, example: TrainExample, guidance, *, quant, replay, temperature, record: bool
):
  """(log pi_old, entropy, guidance fallbacks, training-path site records): the records
  (full QArrays, for the per-layer disagreement) only when `record`."""
  if record:
    quant = quant.replace(recording=Recording(form="full"))
  logp, out = training_forward(
    policy,
    example.tokens,
    example.positions,
    example.mask,
    quant=quant,
    guidance=guidance,
    routing_replay=replay,
    temperature=temperature,
  )
  return logp, token_entropy(out.logits, temperature), out.fallbacks, out.sites


# The policy's and the optimizer's state are donated: the update writes them in place, so a
# step holds one copy of parameters and Adam moments, not two. Whatever shares those buffers
# is stale after a step: the rollout engines re-sync when next used, and the KL reference is a
# copy of its own (`Trainer.__init__`).
@functools.partial(
  nnx.jit, static_argnames=_STATIC + ("loss_config", "fused", "record"), donate_argnums=(0, 1)
)
def _train_step(
  policy,
  opt,
  example: TrainExample,
  guidance,
  ref_logp,
  *,
  quant,
  replay,
  temperature,
  loss_config,
  fused: bool = False,
  record: bool = False,
):
  """One GRPO update on `example` (a minibatch): (loss, stats, gradient norm).

  fused: the step's only update (one minibatch, one epoch). pi_old is then the policy this
  update starts from, so its log-probs are this forward's own, held without gradient
  (`example.old_logp` is not read and `_old_logprobs` need not run), and the update also
  returns what `_old_logprobs` would have: log pi_old, token entropy, guidance fallbacks
  and (with `record`) the training path's site records."""
  if record:
    quant = quant.replace(recording=Recording(form="full"))

  def loss_fn(policy):
    logp, out = training_forward(
      policy,
      example.tokens,
      example.positions,
      example.mask,
      quant=quant,
      guidance=guidance,
      routing_replay=replay,
      temperature=temperature,
    )
    old_logp = jax.lax.stop_gradient(logp) if fused else example.old_logp
    loss, stats = grpo_loss(
      logp,
      old_logp,
      example.rollout_logp,
      example.advantages,
      example.response_mask,
      loss_config,
      ref_logp,
    )
    scored = ()
    if fused:
      scored = (
        old_logp,
        token_entropy(jax.lax.stop_gradient(out.logits), temperature),
        out.fallbacks,
        out.sites,
      )
    return loss + policy.cfg.router_aux_loss_coef * out.lb_loss, (stats, scored)

  (loss, (stats, scored)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(policy)
  opt.update(policy, grads)
  return (loss, stats, optax.global_norm(grads)) + tuple(scored)


@nnx.jit
def _param_health(policy) -> tuple[jax.Array, jax.Array]:
  """(every parameter finite, max |parameter|): the divergence guard's two numbers."""
  leaves = jax.tree.leaves(nnx.state(policy, nnx.Param))
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
  max_abs = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in leaves]))
  return finite, max_abs


@dataclasses.dataclass(frozen=True)
class _Collected:
  """What `Trainer._collect` hands on: the played episodes, their (trimmed) rollout, the
  training example and the arm's guidance (on the device)."""

  played: episodes_lib.Episodes
  rollout: Any
  example: TrainExample
  guidance: Any


@dataclasses.dataclass(frozen=True)
class _Scored:
  """What `Trainer._score` hands on: the example with pi_old and advantages, and what the
  metrics read of the training path."""

  example: TrainExample
  guidance: Any
  ref_logp: Any
  entropy: Any
  fallbacks: dict
  train_sites: dict


class DivergenceError(FloatingPointError):
  """An update made the loss, the gradient or the parameters non-finite or unbounded."""


@functools.lru_cache(maxsize=None)
def _optimizer(learning_rate: float, warmup_updates: int = 0):
  """One transformation per (learning rate, warmup), so runs of one config share compiled
  steps. A linear warmup from lr / 10 over the first `warmup_updates` optimizer updates:
  Adam's first updates are sign-like (every parameter moves by ~lr whatever its gradient's
  size), which on a noisy RL gradient undoes part of the warm start."""
  schedule = learning_rate
  if warmup_updates > 0:
    schedule = optax.linear_schedule(learning_rate / 10, learning_rate, warmup_updates)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


def check_workdir(workdir: str) -> str:
  """An absolute, writable workdir (created), or a ValueError before any work."""
  path = os.path.abspath(workdir)
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write_test.{os.getpid()}")  # one per process (multi-host)
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"workdir {workdir!r} is not writable: {e}") from e
  return path


class Trainer:
  """One RL run in `workdir` (resumed if the workdir holds a checkpoint of the same config).

  The workdir is locked for the Trainer's life (`utils.lock`: a second run on it is refused
  before anything is written); `close()` (or `with Trainer(...) as trainer:`) releases it,
  as do garbage collection and the process's exit."""

  def __init__(self, config: RLConfig, workdir: str, *, progress: bool = True):
    self._unlock = weakref.finalize(self, _release, lock_run_workdir(workdir))
    try:
      self._init(config, workdir, progress)
    except BaseException:
      self.close()
      raise

  def close(self) -> None:
    """Release the workdir (idempotent)."""
    self._unlock()

  def __enter__(self) -> "Trainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _init(self, config: RLConfig, workdir: str, progress: bool) -> None:
    self.config = config
    self.workdir = check_workdir(workdir)
    self.progress = progress
    self.checkpoints = Checkpoints(os.path.join(self.workdir, "checkpoints"))
    self._check_saved_config()
    self.metrics_path = os.path.join(self.workdir, "metrics.jsonl")
    if os.path.exists(self.metrics_path):  # a damaged log fails here, before any work
      read_jsonl(self.metrics_path)
    self.task = get_task(config.task, **dict(config.task_options))
    # The preset with the character tokenizer, or a checkpoint with its own (policy_source).
    self.source = policy_source.load(config, self.task)
    self.tokenizer, self.model_cfg = self.source.tokenizer, self.source.model_cfg
    self.arm = config.arm_spec
    self.mesh = make_mesh(*config.mesh) if np.prod(config.mesh) > 1 else None

    self.policy = self.source.policy
    if self.mesh is not None:  # placed before the warm start: its save is then multi-host safe
      shard_model(self.policy, self.mesh)
    if policy_source.warm_start(config):
      self.warmstart = warmstart.load_or_train(
        self.policy,
        self.workdir,
        self.task,
        self.tokenizer,
        steps=config.sft_steps,
        batch=config.sft_batch,
        seed=config.seed,
        learning_rate=config.sft_learning_rate,
        progress=progress,
        mesh=self.mesh,
      )
    else:
      self.warmstart = policy_source.skipped_warm_start(self.task)
    self.reference = None
    if config.loss.kl_coef > 0:  # a frozen copy of the warm start (its own buffers: the
      graphdef, state = nnx.split(self.policy)  # train step donates the policy's)
      self.reference = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    self.opt = nnx.Optimizer(
      self.policy,
      _optimizer(config.learning_rate, config.lr_warmup_steps * config.minibatches * config.epochs),
      wrt=nnx.Param,
    )
    if self.mesh is not None:  # Adam's moments FSDP-sharded like their parameters
      shard_optimizer(self.opt, self.policy, self.mesh)
    self.step = 0
    self._restore_latest()

    base = episodes_lib.rollout_base(config, self.task, self.source)
    # Every arm whose two paths both run FP4 captures (at least compact) guidance on every
    # layer, so the paths' per-layer disagreement is measured each step; the trainer uses
    # only the arm's own guided layers of it.
    self.measured = self.arm.rollout_precision == "fp4" and config.train_quant is not None
    # One update per step: pi_old's log-probs come from that update's own forward.
    self.fused = config.minibatches == 1 and config.epochs == 1
    capture = self.arm.guidance
    if self.measured and capture == "none":
      capture = "compact"
    self._engine = RolloutEngine(
      self.policy,
      base.replace(
        precision=self.arm.rollout_precision,
        guidance=capture,
        guided_layers="all" if self.measured else self.arm.guided_layers,
        record_routing=self.arm.routing_replay,
      ),
      mesh=self.mesh,
    )
    self.guided_layers = resolve_layers(self.arm.guided_layers, self.model_cfg.num_layers)
    self._greedy = base.replace(
      sampling=SamplingConfig(
        greedy=True, max_new_tokens=config.max_new_tokens, stop_tokens=self.source.stop_tokens
      ),
      guidance="none",
      record_routing=False,
    )
    # Weight sync bookkeeping: the step whose weights the policy holds, and per engine (and
    # per rollout precision) the step whose weights it holds; engines start synced.
    self._weights_step = self.step
    self._engine_step = {id(self._engine): self.step}
    self._made_weights = {}
    self.eval_items = self.task.sample(
      data.eval_seed(config.seed), config.eval_size, split="eval"
    )  # held out, where the task holds any
    self._truncate_metrics(self.step)

  @functools.cached_property
  def eval_engines(self) -> dict[str, RolloutEngine]:
    """The greedy evaluation engines, FP4 and bf16, made when first used (a run with
    eval_every=0 never pays their weight packing)."""
    engines = {
      precision: RolloutEngine(
        self.policy, self._greedy.replace(precision=precision), mesh=self.mesh
      )
      for precision in ("fp4", "bf16")
    }
    for engine in engines.values():  # synced with the weights the policy holds now
      self._engine_step[id(engine)] = self._weights_step
    return engines

  @property
  def engine(self) -> RolloutEngine:
    """The arm's rollout engine, holding the current policy's rollout weights."""
    return self._synced(self._engine)

  # --- state --------------------------------------------------------------------------------

  def _state(self) -> dict:
    state = {"policy": nnx.state(self.policy), "opt": nnx.state(self.opt)}
    if self.reference is not None:
      state["reference"] = nnx.state(self.reference)
    return state

  def _check_saved_config(self) -> None:
    """Refuse a resume with another config before any work (from the newest readable meta)."""
    for step in self.checkpoints.all_steps():
      try:
        saved = self.checkpoints.read_meta(step)["config"]
      except Exception:  # noqa: BLE001 - a damaged checkpoint: restore skips it and says so
        continue
      differing = self.config.differences(saved)
      if differing:
        raise ValueError(
          f"{self.workdir} holds a checkpoint of a different config; fields that "
          f"differ: {differing} (use another --workdir)"
        )
      return

  def _restore_latest(self) -> None:
    found = self.checkpoints.restore_latest(self._state())
    if found is None:
      return
    _, restored, meta = found
    nnx.update(self.policy, restored["policy"])
    nnx.update(self.opt, restored["opt"])
    if self.reference is not None:
      nnx.update(self.reference, restored["reference"])
    self.step = int(meta["step"])

  def save(self) -> None:
    meta = {
      "step": self.step,
      "config": self.config.to_dict(),
      "seed_key": [int(x) for x in jax.random.key_data(self._key(self.step))],
    }
    self.checkpoints.save(self.step, self._state(), meta)

  def _truncate_metrics(self, step: int) -> None:
    """Keep only the metrics lines of the steps the resumed checkpoint holds (none when
    starting from step 0: `run` logs the step-0 evaluation again); a torn last line goes."""
    if not os.path.exists(self.metrics_path) or not is_main_process():
      return
    records = read_jsonl(self.metrics_path)
    kept = [r for r in records if step > 0 and r.get("step", 0) <= step]
    write_atomic(self.metrics_path, "".join(json_line(r) for r in kept))

  # --- one step -----------------------------------------------------------------------------

  def _key(self, step: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(self.config.seed), step)

  def _prompt_ids(self, items):
    return [data.prompt_ids(self.tokenizer, item) for item in items]

  def _static(self) -> dict:
    """The jitted steps' static arguments: the training path's one QuantConfig (the arm's
    quantization, None for bf16, in the run's compute dtype), replay, temperature."""
    return dict(
      quant=call_config(self.config.train_quant, compute_dtype=self.config.compute_dtype),
      replay=self.arm.routing_replay,
      temperature=self.config.temperature,
    )

  def _shard(self, tree, axis: int = 0):
    """Split the batch axis of every array over the mesh's "data" axis."""
    if self.mesh is None or tree is None:
      return tree
    # From host values: each process transfers its own rows (multi-host too).
    return jax.tree.map(
      lambda a: global_array(host_array(a), batch_sharding(self.mesh, a.ndim, axis)), tree
    )

  def _shard_guidance(self, guidance):
    """Place guidance by `guidance_specs` (the rollout's layout, the planner's bytes)."""
    if self.mesh is None or guidance is None:
      return guidance
    specs = guidance_specs(guidance, self.mesh)
    return jax.tree.map(
      lambda a, s: global_array(host_array(a), NamedSharding(self.mesh, s)), guidance, specs
    )

  def train_step(self) -> dict:
    """One RL step: collect -> score -> update -> log; returns its metrics."""
    step = self.step + 1
    start = time.time()
    collected = self._collect(step)
    rollout_seconds = time.time() - start
    start = time.time()
    scored = self._score(step, collected)
    losses, stats_list, norms, scored = self._update(step, scored)
    train_seconds = time.time() - start
    metrics = self._metrics(step, collected, scored, losses, stats_list, norms)
    metrics.update(rollout_seconds=rollout_seconds, train_seconds=train_seconds)
    self.step = step
    return metrics

  def _collect(self, step: int) -> "_Collected":
    """Roll out this step's problems with the arm's engine; keep the guidance on the
    device (the trainer consumes it at once) and select the arm's own guided layers."""
    config = self.config
    problems = self.task.sample(1_000_003 * config.seed + step, config.prompts_per_step)
    items = [item for item in problems for _ in range(config.group_size)]
    played = episodes_lib.play(self.engine, self.task, self.tokenizer, items, self._key(step))
    slots = round_up(played.rollout.used_slots, 16)
    rollout = played.rollout.trim(min(slots, played.rollout.tokens.shape[1]))
    guidance = None
    if rollout.guidance is not None and (self.arm.guidance != "none" or self.arm.routing_replay):
      guidance = self._shard_guidance(rollout.guidance.select_layers(self.guided_layers))
    example = TrainExample(
      **self._shard(
        {
          "tokens": rollout.tokens,
          "positions": rollout.positions,
          "mask": rollout.mask,
          "response_mask": rollout.response_mask,
          "rollout_logp": rollout.logprobs,
        }
      )
    )
    return _Collected(played=played, rollout=rollout, example=example, guidance=guidance)

  def _score(self, step: int, c: "_Collected") -> "_Scored":
    """pi_old (and the reference's log-probs) on the training path, and the advantages (of
    `advantage_rewards`); the training path's site records only where the disagreement
    metrics read them."""
    config, static = self.config, self._static()
    old_logp = entropy = fallbacks = train_sites = None  # the fused update gives them
    if not self.fused:
      old_logp, entropy, fallbacks, train_sites = _old_logprobs(
        self.policy, c.example, c.guidance, record=self.measured, **static
      )
    ref_logp = None
    if self.reference is not None:
      ref_logp = _old_logprobs(self.reference, c.example, c.guidance, record=False, **static)[0]
    advantages = group_advantages(
      jnp.asarray(self.advantage_rewards(step, c.played.rewards)),
      config.group_size,
      std_norm=config.loss.std_norm,
    )
    example = c.example.replace(old_logp=old_logp, advantages=self._shard(advantages))
    return _Scored(
      example=example,
      guidance=c.guidance,
      ref_logp=ref_logp,
      entropy=entropy,
      fallbacks=fallbacks,
      train_sites=train_sites,
    )

  def advantage_rewards(self, step: int, rewards: np.ndarray) -> np.ndarray:
    """The rewards the advantages are computed from: the episodes' own, or with
    `reward_control="shuffle"` the same rewards permuted across the whole batch (by the
    seed and the step, the same on every process), which keeps their mean and spread and
    breaks their link to the completions."""
    if self.config.reward_control == "shuffle":
      return np.random.default_rng([self.config.seed, step]).permutation(rewards)
    return rewards

  def _update(self, step: int, s: "_Scored"):
    """Minibatch GRPO updates; raises DivergenceError before anything of a bad step is kept.
    Returns (losses, stats, grad norms, the scored batch with pi_old's forward filled in)."""
    config, static = self.config, self._static()
    if self.fused:  # one update: pi_old's forward is the update's own
      loss, stats, norm, old_logp, entropy, fallbacks, sites = _train_step(
        self.policy,
        self.opt,
        s.example,
        s.guidance,
        s.ref_logp,
        loss_config=config.loss_config,
        fused=True,
        record=self.measured,
        **static,
      )
      s = dataclasses.replace(
        s,
        example=s.example.replace(old_logp=old_logp),
        entropy=entropy,
        fallbacks=fallbacks,
        train_sites=sites,
      )
      return self._finish_update(step, [(loss, stats, norm)]) + (s,)
    guidance = s.guidance
    updates = []  # (loss, stats, grad norm) per minibatch, left on device until all ran
    size = config.batch // config.minibatches
    for _ in range(config.epochs):
      for m in range(config.minibatches):
        mini, mini_guidance, mini_ref = s.example, guidance, s.ref_logp
        if config.minibatches > 1:  # (one minibatch: the whole batch, no gather)
          rows = np.arange(m * size, (m + 1) * size)
          mini = jax.tree.map(lambda a: a[rows], s.example)
          mini_guidance = None if guidance is None else guidance.take(rows)
          mini_ref = None if s.ref_logp is None else s.ref_logp[rows]
        updates.append(
          _train_step(
            self.policy,
            self.opt,
            mini,
            mini_guidance,
            mini_ref,
            loss_config=config.loss_config,
            **static,
          )
        )
    return self._finish_update(step, updates) + (s,)

  def _finish_update(self, step: int, updates: list) -> tuple:
    """(losses, stats, grad norms) of a step's updates, checked for divergence."""
    (losses, stats_list, norms), (finite, max_abs) = jax.device_get(
      (tuple(zip(*updates)), _param_health(self.policy))
    )
    self._check_update(step, losses, norms, bool(finite), float(max_abs))
    if self.mesh is not None:  # XLA may pick other layouts for the outputs: keep the rules'
      shard_model(self.policy, self.mesh)  # (a no-op for every array already placed so)
      shard_optimizer(self.opt, self.policy, self.mesh)
    self._weights_step = step  # the rollout weights are re-made when next needed
    return losses, stats_list, norms

  def _metrics(self, step: int, c: "_Collected", s: "_Scored", losses, stats_list, norms) -> dict:
    """The step's metrics line (DESIGN.md section 4 names)."""
    config, played, rollout = self.config, c.played, c.rollout
    response_mask = host_array(rollout.response_mask)
    metrics = {
      "step": step,
      "rewards/mean": float(np.mean(played.rewards)),
      "rewards/std": float(np.std(played.rewards)),
      "loss": float(np.mean(losses)),
      "grad_norm": float(np.mean(norms)),
      **{name: float(np.mean([x[name] for x in stats_list])) for name in stats_list[0]},
      "entropy": float(np.sum(host_array(s.entropy) * response_mask) / max(response_mask.sum(), 1)),
      "completions/mean_length": float(response_mask.sum(1).mean()),
      "episodes/mean_turns": float(played.turns.mean()),
      # per real token (sparse guidance is measured on its data)
      "guidance/bytes_per_token": 0.0
      if c.guidance is None or self.arm.guidance == "none"
      else float(c.guidance.bytes_per_token(host_array(rollout.mask))),
      "kernels/rollout": self._engine.kernels,
    }  # "pallas" or "xla": what ran
    if self._engine.kernels_fallback:
      metrics["kernels/fallback_reason"] = self._engine.kernels_fallback
    metrics.update(group_reward_metrics(played.rewards, config.group_size))
    metrics.update(
      mismatch_metrics(
        rollout.logprobs,
        s.example.old_logp,
        rollout.response_mask,
        tis_threshold=config.loss.tis_threshold,
      )
    )
    mask = host_array(rollout.mask)
    fallbacks, train_sites = jax.tree.map(host_array, (s.fallbacks, s.train_sites))
    metrics.update(guidance_agreement(fallbacks, mask))
    if c.guidance is not None and c.guidance.mode == "sparse":  # densities, overflow
      stats = c.guidance.sparse_stats(mask)
      metrics.update({k: v for k, v in stats.items() if k != "per_site"})
    # Bits and scales always; codes if full (a sparse capture holds neither everywhere).
    if self.measured and rollout.guidance is not None and rollout.guidance.mode != "sparse":
      metrics.update(
        disagreement_metrics(jax.tree.map(host_array, rollout.guidance.sites), train_sites, mask)
      )
    return metrics

  def _synced(self, engine: RolloutEngine) -> RolloutEngine:
    """`engine` with the current policy's rollout weights: the weight sync (FP4 packing)
    runs once per step per rollout precision actually used, when an engine is about to
    run, so evaluation engines that run every `eval_every` steps sync only then."""
    if self._engine_step.get(id(engine)) != self._weights_step:
      weights = (engine.config.quant, engine.config.compute_dtype)
      made = self._made_weights.get(weights)
      if made is None or made[0] != self._weights_step:
        engine.sync(self.policy)
        self._made_weights[weights] = (self._weights_step, engine.graphdef, engine.params)
      else:
        engine.graphdef, engine.params = made[1], made[2]
      self._engine_step[id(engine)] = self._weights_step
    return engine

  def _check_update(self, step, losses, norms, finite: bool, max_abs: float) -> None:
    """Raise DivergenceError if step `step` broke the policy (before it is logged or saved)."""
    limit = self.config.max_param_abs
    problems = []
    if not np.all(np.isfinite(losses)):
      problems.append(f"the loss is {[float(x) for x in losses]}")
    if not np.all(np.isfinite(norms)):
      problems.append(f"the gradient norm is {[float(x) for x in norms]}")
    if not finite:
      problems.append("parameters hold NaN or Inf")
    elif max_abs > limit:
      problems.append(f"max |parameter| is {max_abs:.3g}, beyond RLConfig.max_param_abs={limit:g}")
    if not problems:
      return
    saved = self.checkpoints.latest_step()
    keep = (
      f"the latest checkpoint, step {saved} in {self.checkpoints.directory}, is the last "
      f"good one and a rerun resumes from it"
      if saved is not None
      else "no checkpoint was saved before it"
    )
    raise DivergenceError(
      f"step {step} diverged: {'; '.join(problems)}. Nothing of step {step} "
      f"was saved; {keep}. Lower --learning_rate (now "
      f"{self.config.learning_rate:g}) and rerun."
    )

  # --- evaluation ---------------------------------------------------------------------------

  def evaluate(self) -> dict:
    """Greedy reward on the fixed evaluation problems, in FP4 and in bf16."""
    out = {}
    if not self.eval_items:
      return out
    key = jax.random.key(0)
    for precision, engine in self.eval_engines.items():
      played = episodes_lib.play(
        self._synced(engine), self.task, self.tokenizer, self.eval_items, key
      )
      out[f"eval/reward_{precision}"] = float(np.mean(played.rewards))
    return out

  # --- the run --------------------------------------------------------------------------------

  def log(self, metrics: dict) -> None:
    if is_main_process():  # multi-host: one metrics file, written once
      append_jsonl(self.metrics_path, metrics)

  def run(self) -> list[dict]:
    """Train until config.steps; returns the metrics of the steps run now."""
    config = self.config
    context = jax.set_mesh(self.mesh) if self.mesh is not None else _nullcontext()
    history = []
    with context:
      if self.step == 0 and config.eval_every:
        self.log({"step": 0, **self.evaluate()})
      bar = tqdm(
        range(self.step, config.steps),
        desc=f"rl {config.arm}",
        disable=not self.progress,
        initial=self.step,
        total=config.steps,
      )
      for _ in bar:
        metrics = self.train_step()
        if config.eval_every and (self.step % config.eval_every == 0 or self.step == config.steps):
          metrics.update(self.evaluate())
        self.log(metrics)
        history.append(metrics)
        bar.set_postfix(
          reward=f"{metrics['rewards/mean']:.2f}", k3=f"{metrics['mismatch/k3_kl']:.1e}"
        )
        if config.checkpoint_every and (
          self.step % config.checkpoint_every == 0 or self.step == config.steps
        ):
          self.save()
    return history


def _release(lock) -> None:
  if lock is not None:
    lock.release()


class _nullcontext:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def json_line(record: dict) -> str:
  return json.dumps(record) + "\n"


def read_metrics(workdir: str) -> list[dict]:
  """The metrics lines of a run (a torn last line, from an interrupted append, dropped)."""
  return read_jsonl(os.path.join(os.path.abspath(workdir), "metrics.jsonl"))
