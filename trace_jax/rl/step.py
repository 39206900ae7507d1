"""One RL step (DESIGN.md section 4) as functions over typed values:

  1. `collect`: sample `prompts_per_step` problems, `group_size` samples each, and roll them
     out with the arm's engine (one or more turns), capturing its guidance; the arm's guided
     layers of it stay on the device (the update consumes them at once);
  2. `score`: the advantages, the reference policy's log-probs (KL: its own unguided
     forward, nearest rounding and its own routing), and pi_old: the
     training path's log-probs of the sampled tokens with the arm's quantization, guidance
     and routing replay; the mismatch metrics compare them with the rollout's. A fused step
     (one minibatch, one epoch) leaves pi_old to the update: its own forward gives it;
  3. `update`: minibatch GRPO updates (optax) of the policy in `RLState`; each advances the
     policy version, against which the rollout engines re-make their weights (`rl.sync`);
  4. `step_metrics`, and `check_update`: the divergence guard, which raises before anything
     of a bad step is logged or saved.

The compiled programs it runs (pi_old's forward, the update) are `rl.programs`'.
Everything random derives from (seed, step).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding

from trace_jax.guidance import Guidance
from trace_jax.model.quant import CallOptions, resolve_layers
from trace_jax.model.sharding import (
  batch_sharding,
  data_shards,
  guidance_specs,
  shard_model,
  shard_optimizer,
)
from trace_jax.rl import episodes as episodes_lib
from trace_jax.rl.arms import Arm
from trace_jax.rl.config import RLConfig
from trace_jax.rl.decoupled import DecoupledConfig
from trace_jax.rl.grpo import group_advantages
from trace_jax.rl.optimizer import run_optimizer
from trace_jax.rl.metrics import (
  disagreement_metrics,
  group_reward_metrics,
  guidance_agreement,
  mismatch_metrics,
  router_flip_metrics,
)
from trace_jax.rl.programs import TrainExample, loss_static, old_logprobs, param_health, train_step
from trace_jax.rollout.engine import Rollout, RolloutEngine
from trace_jax.utils import round_up
from trace_jax.utils.distributed import global_array, host_array


class DivergenceError(FloatingPointError):
  """An update made the loss, the gradient or the parameters non-finite or unbounded."""


@struct.dataclass
class RLState:
  """What a run updates, one pytree (nnx modules are pytrees). The update donates the
  policy's and the optimizer's buffers, so whatever shares them is stale after it: the
  rollout engines re-sync by `version`, and the reference is a copy of its own."""

  policy: Any  # Transformer: the master weights
  opt: nnx.Optimizer  # Adam over the policy's nnx.Param
  reference: Any = None  # Transformer: a frozen copy of the initial policy (kl_coef > 0)
  step: int = 0  # RL steps done
  version: int = 0  # policy updates done: rollout weights are made per version (`rl.sync`)


@struct.dataclass
class Collected:
  """What `collect` hands on."""

  played: episodes_lib.Episodes = struct.field(pytree_node=False)  # rewards [B], turns [B]
  rollout: Rollout = struct.field(pytree_node=False)  # trimmed to the used slots
  example: TrainExample  # [B, S], on the mesh
  guidance: Guidance | None  # the arm's guided layers (+ routing); None if it reads none
  # rollout/slot_utilization, rollout/tokens_per_second, rollout/prefill_shared_frac
  rollout_metrics: dict = struct.field(pytree_node=False, default_factory=dict)


@struct.dataclass
class Scored:
  """The batch the update trains on, and what the metrics read of the training path."""

  example: TrainExample  # with advantages [B] (and old_logp [B, S] unless the step is fused)
  guidance: Guidance | None
  ref_logp: jax.Array | None  # float32 [B, S], the reference's log-probs (kl_coef > 0)
  entropy: jax.Array | None  # float32 [B, S], the training path's token entropy
  fallbacks: dict | None  # {(layer, site): bool [B, S, ...]}, guided elements that fell back
  train_sites: dict | None  # {(layer, site): fp4.QArray}, training-path records (measured)
  router_choice: jax.Array | None = None  # int32 [num_moe_layers, B, S, k], the routers' own


@dataclasses.dataclass(frozen=True)
class Update:
  """What `update` did, on the host: one entry per optimizer update (epoch x minibatch)."""

  losses: tuple  # float32 scalars
  stats: tuple  # grpo_loss statistics, dicts of scalars
  grad_norms: tuple  # float32 scalars
  params_finite: bool  # every parameter finite after the updates
  max_param_abs: float  # max |parameter| after the updates
  scored: Scored  # the batch, with the fused update's pi_old forward filled in


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSpec:
  """What the step functions read of a run, fixed for the run (`StepSpec.of`)."""

  config: RLConfig
  guided_layers: tuple[int, ...]  # the arm's guided layers of this model
  fused: bool  # one update per step: pi_old is that update's own forward
  mesh: Any = None  # batch rows over its "data" axis
  # Asynchronous RL (max_staleness > 0): the decoupled loss, pi_old the proximal policy and
  # the rollout's log-probs the behaviour policy (`rl.decoupled`); None: `grpo_loss`.
  decoupled: DecoupledConfig | None = None

  @classmethod
  def of(cls, config: RLConfig, num_layers: int, mesh=None) -> "StepSpec":
    return cls(
      config=config,
      guided_layers=resolve_layers(config.arm_spec.guided_layers, num_layers),
      fused=config.schedule.minibatches == 1 and config.schedule.epochs == 1,
      mesh=mesh,
      decoupled=config.decoupled if config.schedule.max_staleness > 0 else None,
    )

  @property
  def arm(self) -> Arm:
    return self.config.arm_spec

  @property
  def static(self) -> dict:
    """The jitted functions' static arguments: the training path's QuantConfig (the arm's
    quantization in the run's scheme, None for bf16), its call options (the run's compute
    dtype; on a mesh each "data" shard dispatches its own sequences' tokens to the routed
    experts, `CallOptions.moe_blocks`), replay, temperature."""
    config = self.config
    return dict(
      quant=config.train_quant,
      options=CallOptions(compute_dtype=config.compute_dtype, moe_blocks=data_shards(self.mesh)),
      replay=self.arm.routing_replay,
      temperature=config.sampling.temperature,
    )

  @property
  def reference_static(self) -> dict:
    """The reference's forward (the KL term): the training path's FP4 format and sites,
    rounded to nearest with its own scales and its own experts. Guidance and routing replay
    are the rollout's record of the current policy's activations: read by the frozen
    reference, they would round it with the policy's scales and route it to the policy's
    experts, and the KL would not measure the distance to the reference."""
    static = self.static
    quant = static["quant"]
    nearest = None if quant is None else quant.replace(rounding="nearest")
    return dict(static, quant=nearest, replay=False)


def init_state(config: RLConfig, policy, *, mesh=None) -> RLState:
  """A fresh state around `policy` (placed, warm-started): its optimizer (Adam's moments
  placed like their parameters on a mesh) and, with kl_coef > 0, the reference copy."""
  reference = None
  if config.loss.kl_coef > 0:  # its own buffers: the update donates the policy's
    graphdef, state = nnx.split(policy)
    reference = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
  opt = nnx.Optimizer(policy, run_optimizer(config, scans_layers(policy)), wrt=nnx.Param)
  if mesh is not None:
    shard_optimizer(opt, policy, mesh)
  else:  # jit compiles anew when an input turns from uncommitted (the optimizer's step
    # counters; the policy after a warm start made in this process) to committed, as the
    # first update's outputs are: the second update and rollout would compile again
    _commit(policy)
    _commit(opt)
  return RLState(policy=policy, opt=opt, reference=reference)


def scans_layers(policy) -> bool:
  """Whether `policy` runs its layers under a scan (ModelConfig.scan_layers): its optimizer
  then runs over its parameters stacked by layer (`optimizer(by_layer=True)`)."""
  return bool(getattr(getattr(policy, "cfg", None), "scan_layers", False))


def _commit(module) -> None:
  """Commit every array of `module` to the device it lives on (in place)."""

  def place(a):
    if not isinstance(a, jax.Array) or a.committed:
      return a
    return jax.device_put(a, next(iter(a.devices())))

  nnx.update(module, jax.tree.map(place, nnx.state(module)))


def step_key(seed: int, step: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed), step)


def _place(tree, mesh, specs=None):
  """On a mesh, from host values (each process transfers its own rows, multi-host too): the
  batch axis of every array over "data", or by `specs` (guidance: `guidance_specs`)."""
  if mesh is None or tree is None:
    return tree
  if specs is None:
    specs = jax.tree.map(lambda a: batch_sharding(mesh, a.ndim).spec, tree)
  place = lambda a, s: global_array(host_array(a), NamedSharding(mesh, s))  # noqa: E731
  return jax.tree.map(place, tree, specs)


def collect(
  spec: StepSpec, engine: RolloutEngine, task, tokenizer, step: int, version: int = 0
) -> Collected:
  """Roll out step `step`'s problems with `engine` (synced to the policy at `version`:
  `rl.sync`). A skewed engine (RLConfig.rollout_skew) hashes `version` and each row's
  sequence id in the run, (step - 1) * batch + row, into its perturbation."""
  config, arm = spec.config, spec.arm
  problems = task.sample(1_000_003 * config.seed + step, config.sampling.prompts_per_step)
  items = [item for item in problems for _ in range(config.sampling.group_size)]
  first = (step - 1) * len(items)
  engine.take_stats()  # (what ran before this step: not this step's)
  start = time.perf_counter()
  played = episodes_lib.play(
    engine,
    task,
    tokenizer,
    items,
    step_key(config.seed, step),
    version=version,
    sequences=range(first, first + len(items)),
  )
  slots = round_up(played.rollout.used_slots, 16)  # (a host read: the rollout is done)
  stats = engine.take_stats()
  stats.seconds = time.perf_counter() - start  # the whole episodes' wall time, either engine
  rollout_metrics = stats.metrics()
  rollout = played.rollout.trim(min(slots, played.rollout.tokens.shape[1]))
  guidance = None
  if rollout.guidance is not None and (arm.guidance != "none" or arm.routing_replay):
    guidance = rollout.guidance.select_layers(spec.guided_layers)
    if spec.mesh is not None:  # the rollout's layout, the planner's bytes
      guidance = _place(guidance, spec.mesh, guidance_specs(guidance, spec.mesh))
  arrays = {
    "tokens": rollout.tokens,
    "positions": rollout.positions,
    "mask": rollout.mask,
    "response_mask": rollout.response_mask,
    "rollout_logp": rollout.logprobs,
  }
  example = TrainExample(**_place(arrays, spec.mesh))
  return Collected(
    played=played,
    rollout=rollout,
    example=example,
    guidance=guidance,
    rollout_metrics=rollout_metrics,
  )


def on_mesh(collected: Collected, mesh) -> Collected:
  """`collected`, made on another device group's mesh (or `on_host`'s copy of it), moved
  onto `mesh` (`jax.device_put`: device to device, or host to device): every batch array
  with its rows over "data" (routing [L, B, S, k] along its axis 1) and guidance by
  `guidance_specs`, the layouts `collect` gives on `mesh`. The trimmed rollout moves too
  (the step's metrics read it beside the training path's arrays); the untrimmed one (its
  cache) is dropped."""

  def rows(tree, axis=0):
    put = lambda a: jax.device_put(a, batch_sharding(mesh, a.ndim, axis))  # noqa: E731
    return None if tree is None else jax.tree.map(put, tree)

  def guidance(g):
    if g is None:
      return None
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    return jax.tree.map(put, g, guidance_specs(g, mesh))

  return _moved(collected, rows, guidance)


def on_host(collected: Collected) -> Collected:
  """`collected` with every array `on_mesh` moves read into host memory (numpy, the same
  bits), the untrimmed rollout dropped: what a batch made in one process is sent to
  another as (`on_mesh` there places it on the learner's mesh)."""
  rows = lambda tree, axis=0: None if tree is None else jax.tree.map(np.asarray, tree)  # noqa: E731
  return _moved(collected, rows, rows)


def _moved(collected: Collected, rows, guidance) -> Collected:
  """`collected` with its batch arrays through `rows(tree, axis)` and its guidance through
  `guidance(g)`; the untrimmed rollout (its cache) dropped."""
  r = collected.rollout
  fields = ("tokens", "positions", "prompt_mask", "response_mask", "env_mask", "logprobs")
  rollout = dataclasses.replace(
    r,
    **{f: rows(getattr(r, f)) for f in fields + ("sampling_logprobs", "finish", "site_inputs")},
    guidance=guidance(r.guidance),
    routing=rows(r.routing, axis=1),
    cache=None,
  )
  return Collected(
    played=dataclasses.replace(collected.played, rollout=rollout),
    rollout=rollout,
    example=rows(collected.example),
    guidance=guidance(collected.guidance),
    rollout_metrics=collected.rollout_metrics,
  )


def advantage_rewards(config: RLConfig, step: int, rewards: np.ndarray) -> np.ndarray:
  """The rewards the advantages are computed from: the episodes' own, or a placebo's.

  `reward_control="shuffle"` (the matched placebo) permutes each group's rewards within the
  group: every group keeps its reward multiset, so the same groups carry advantages of the
  same sizes as in the real run, and only which sample earned them is lost.
  `"shuffle_batch"` permutes across the whole batch: almost no group keeps equal rewards,
  so nearly every group gets advantages, more noise than the real run injects. Both draw
  from (seed, step) alone, the same on every process.
  """
  if config.reward_control == "none":
    return rewards
  rng = np.random.default_rng([config.seed, step])
  if config.reward_control == "shuffle_batch":
    return rng.permutation(rewards)
  groups = np.asarray(rewards).reshape(-1, config.sampling.group_size)
  return rng.permuted(groups, axis=1).reshape(-1)


def score(spec: StepSpec, state: RLState, collected: Collected, step: int) -> Scored:
  """pi_old (unless fused) and the reference's log-probs on the training path, and the
  advantages; the training path's site records only where the metrics read them."""
  config, static, c = spec.config, spec.static, collected
  old_logp = entropy = fallbacks = train_sites = router_choice = None  # or the fused update
  if not spec.fused:
    old_logp, entropy, fallbacks, train_sites, router_choice = old_logprobs(
      state.policy, c.example, c.guidance, record=spec.arm.measured, **static
    )
  ref_logp = None
  if state.reference is not None:
    ref_logp = old_logprobs(
      state.reference, c.example, None, record=False, **spec.reference_static
    )[0]
  advantages = group_advantages(
    jnp.asarray(advantage_rewards(config, step, c.played.rewards)),
    config.sampling.group_size,
    std_norm=config.loss.std_norm,
  )
  return Scored(
    example=c.example.replace(old_logp=old_logp, advantages=_place(advantages, spec.mesh)),
    guidance=c.guidance,
    ref_logp=ref_logp,
    entropy=entropy,
    fallbacks=fallbacks,
    train_sites=train_sites,
    router_choice=router_choice,
  )


def update(spec: StepSpec, state: RLState, scored: Scored) -> tuple[RLState, Update]:
  """The step's GRPO updates of `state` (its policy and optimizer buffers are donated:
  updated in place); returns the next state (one version on) and what the updates did."""
  config, static, s = spec.config, spec.static, scored
  if spec.fused:  # one update: pi_old's forward is the update's own
    loss, stats, norm, old_logp, entropy, fallbacks, sites, choice = train_step(
      state.policy,
      state.opt,
      s.example,
      s.guidance,
      s.ref_logp,
      loss_config=config.loss_config,
      fused=True,
      record=spec.arm.measured,
      mesh=spec.mesh,
      **loss_static(spec),
      **static,
    )
    s = s.replace(
      example=s.example.replace(old_logp=old_logp),
      entropy=entropy,
      fallbacks=fallbacks,
      train_sites=sites,
      router_choice=choice,
    )
    updates = [(loss, stats, norm)]
  else:
    updates = []  # (loss, stats, grad norm) per minibatch, left on device until all ran
    size = config.batch // config.schedule.minibatches
    for _ in range(config.schedule.epochs):
      for m in range(config.schedule.minibatches):
        mini, mini_guidance, mini_ref = s.example, s.guidance, s.ref_logp
        if config.schedule.minibatches > 1:  # (one minibatch: the whole batch, no gather)
          rows = np.arange(m * size, (m + 1) * size)
          mini = jax.tree.map(lambda a: a[rows], s.example)
          mini_guidance = None if s.guidance is None else s.guidance.take(rows)
          mini_ref = None if s.ref_logp is None else s.ref_logp[rows]
        updates.append(
          train_step(
            state.policy,
            state.opt,
            mini,
            mini_guidance,
            mini_ref,
            loss_config=config.loss_config,
            **loss_static(spec),
            **static,
          )
        )
  (losses, stats, norms), (finite, max_abs) = jax.device_get(
    (tuple(zip(*updates)), param_health(state.policy))
  )
  if spec.mesh is not None:  # XLA may pick other layouts for the outputs: keep the rules'
    shard_model(state.policy, spec.mesh)  # (a no-op for every array already placed so)
    shard_optimizer(state.opt, state.policy, spec.mesh)
  done = Update(losses, stats, norms, bool(finite), float(max_abs), s)
  return state.replace(step=state.step + 1, version=state.version + 1), done


def check_update(spec: StepSpec, step: int, done: Update, last_good: str, before=None) -> None:
  """Raise DivergenceError if step `step` broke the policy, before it is logged or saved;
  `last_good` says which checkpoint a rerun resumes from. `before`, the policy the step
  started from, is checked only then: weights already non-finite are no fault of the
  learning rate, and the error says so."""
  limit = spec.config.schedule.max_param_abs
  problems = []
  if not np.all(np.isfinite(done.losses)):
    problems.append(f"the loss is {[float(x) for x in done.losses]}")
  if not np.all(np.isfinite(done.grad_norms)):
    problems.append(f"the gradient norm is {[float(x) for x in done.grad_norms]}")
  if not done.params_finite:
    problems.append("parameters hold NaN or Inf")
  elif done.max_param_abs > limit:
    problems.append(
      f"max |parameter| is {done.max_param_abs:.3g}, beyond RLConfig.max_param_abs={limit:g}"
    )
  if not problems:
    return
  if before is not None and not bool(jax.device_get(param_health(before)[0])):
    raise DivergenceError(
      f"step {step} failed: {'; '.join(problems)}, but the policy's weights held NaN or "
      f"Inf before step {step}, so the learning rate is not the cause (the initial "
      "weights are non-finite: a checkpoint loaded with from_hf(allow_nonfinite=True)?). "
      f"Nothing of step {step} was saved; {last_good}."
    )
  raise DivergenceError(
    f"step {step} diverged: {'; '.join(problems)}. Nothing of step {step} was saved; "
    f"{last_good}. Lower --learning_rate (now {spec.config.schedule.learning_rate:g}) and rerun."
  )


def step_metrics(
  spec: StepSpec, step: int, collected: Collected, done: Update, engine: RolloutEngine
) -> dict:
  """The step's metrics line (DESIGN.md section 4 names)."""
  config, arm, played, rollout = spec.config, spec.arm, collected.played, collected.rollout
  s, guidance = done.scored, collected.guidance
  response_mask = host_array(rollout.response_mask)
  stats = done.stats
  metrics = {
    "step": step,
    "rewards/mean": float(np.mean(played.rewards)),
    "rewards/std": float(np.std(played.rewards)),
    "loss": float(np.mean(done.losses)),
    "grad_norm": float(np.mean(done.grad_norms)),
    **{name: float(np.mean([x[name] for x in stats])) for name in stats[0]},
    "entropy": float(np.sum(host_array(s.entropy) * response_mask) / max(response_mask.sum(), 1)),
    "completions/mean_length": float(response_mask.sum(1).mean()),
    "episodes/mean_turns": float(played.turns.mean()),
    # per real token (sparse guidance is measured on its data)
    "guidance/bytes_per_token": 0.0
    if guidance is None or arm.guidance == "none"
    else float(guidance.bytes_per_token(host_array(rollout.mask))),
    "kernels/rollout": engine.kernels,  # "pallas" or "xla": what ran
  }
  if engine.kernels_fallback:
    metrics["kernels/fallback_reason"] = engine.kernels_fallback
  metrics.update(collected.rollout_metrics)
  metrics.update(group_reward_metrics(played.rewards, config.sampling.group_size))
  # the groups that carried advantages: a placebo's permuted rewards, not the true ones
  used = advantage_rewards(config, step, played.rewards)
  mixed = group_reward_metrics(used, config.sampling.group_size)["reward/mixed_group_frac"]
  metrics["reward/advantage_mixed_group_frac"] = mixed
  metrics.update(
    mismatch_metrics(
      rollout.logprobs,
      s.example.old_logp,
      rollout.response_mask,
      tis_threshold=config.loss.tis_threshold,
    )
  )
  metrics.update(router_flip_metrics(rollout.routing, s.router_choice, rollout.mask))
  mask = host_array(rollout.mask)
  fallbacks, train_sites = jax.tree.map(host_array, (s.fallbacks, s.train_sites))
  metrics.update(guidance_agreement(fallbacks, mask))
  if guidance is not None and guidance.mode == "sparse":  # densities, overflow
    sparse = guidance.sparse_stats(mask)
    metrics.update({k: v for k, v in sparse.items() if k != "per_site"})
  # Bits and scales always; codes if full (a sparse capture holds neither everywhere).
  if arm.measured and rollout.guidance is not None and rollout.guidance.mode != "sparse":
    metrics.update(
      disagreement_metrics(jax.tree.map(host_array, rollout.guidance.sites), train_sites, mask)
    )
  return metrics


def version_split(spec: StepSpec, stale_policy, policy, collected: Collected) -> dict:
  """The mismatch split into its two gaps (asynchronous RL): the training path at the
  rollout's own weights (`stale_policy`, the version that generated the batch) against the
  behaviour log-probs is the precision gap (the two paths at the same weights: what TRACE
  removes), and the training path at the current weights (`policy`, the update's start)
  against it the version gap (staleness).

  Both forwards are one compiled program (`old_logprobs`), so at gap 0 the version gap is
  exactly 0: the fused update's own forward (pi_old) is another program, whose bf16
  reduction order differs and FP4 rounding amplifies (k3 ~2e-5 on the tiny preset).

  Returns {"mismatch/precision_k3", "mismatch/version_k3"}: k3 estimates of KL over the
  response tokens, as `mismatch/k3_kl` (which mixes both)."""
  example, guidance = collected.example, collected.guidance
  logp = lambda p: old_logprobs(p, example, guidance, record=False, **spec.static)[0]  # noqa: E731
  stale_logp, current_logp = logp(stale_policy), logp(policy)
  mask = example.response_mask
  precision = mismatch_metrics(example.rollout_logp, stale_logp, mask)
  version = mismatch_metrics(stale_logp, current_logp, mask)
  return {
    "mismatch/precision_k3": precision["mismatch/k3_kl"],
    "mismatch/version_k3": version["mismatch/k3_kl"],
  }
