"""The RL loop (DESIGN.md section 4), built from `rl.step`'s parts:

  for each step: collect -> score -> update (`rl.step`), with the weight sync (`rl.sync`)
  before each rollout; the divergence guard (`rl.step.check_update`) before anything of the
  step is logged or saved; a greedy evaluation in FP4 and in bf16 every `eval_every` steps;
  a checkpoint every `checkpoint_every` steps (and at the last).

The workdir's files are the `RunDir`'s: a resumed run continues exactly as an uninterrupted
one, and a fault leaves the latest checkpoint the last good one.

Asynchronous RL (schedule.max_staleness k > 0): step j + 1 trains on rollouts a background
thread generated with the weights of version max(0, j - k) (`run.async_rollouts`), with the
decoupled loss (`rl.decoupled`); the weights are published after each update, and the
checkpoints hold the older versions the in-flight batches need. k = 0: the plain loop.

Device groups (RLConfig.rollout_devices = N > 0, also with k = 0): the rollouts on the job's
first N devices, the learner's mesh on the devices after them (`run.async_rollouts`); the
greedy evaluation runs on the learner's mesh. Across processes (`jax.distributed`) a process
of the rollout group only serves batches (`run` returns no metrics there) and the learner's
processes train (`Trainer.role`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from trace_jax.model.sharding import make_mesh, shard_model
from trace_jax.rl import data, episodes
from trace_jax.rl import step as step_lib
from trace_jax.rl.config import RLConfig
from trace_jax.rl.pipeline import RolloutWorkerError
from trace_jax.rl.step import RLState, StepSpec
from trace_jax.rl.sync import WeightSync
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.run import async_rollouts, policy_source, remote_rollouts
from trace_jax.run.rundir import RunDir, on_devices
from trace_jax.utils import distributed


class Trainer:
  """One RL run in `workdir` (resumed if the workdir holds a checkpoint of the same config).

  The workdir is locked for the Trainer's life (`RunDir`); `close()` (or `with Trainer(...)
  as trainer:`) releases it, as do garbage collection and the process's exit. `reopen=True`
  opens a finished run at its last checkpoint to read its policy (a post-training
  evaluation); otherwise a workdir that already reached `config`'s steps is refused."""

  def __init__(
    self, config: RLConfig, workdir: str, *, progress: bool = True, reopen: bool = False
  ):
    config = on_devices(config, workdir)  # RLConfig.mesh's -1: the devices left
    self.config, self.progress = config, progress
    # RLConfig.rollout_devices against this job's devices, before any work
    self.groups = async_rollouts.device_groups(config, say_idle=True)
    # across processes: which group this process runs; the learner's first writes the files
    self.role = async_rollouts.group_role(self.groups)
    self.task = policy_source.preflight(config)  # the task and the checkpoint's files
    if self.role is not None:
      async_rollouts.check_across_processes(config, policy_source.warm_start(config, self.task))
      distributed.set_main_process(async_rollouts.learner_process(self.groups))
    # the tokenizer and the template's first renders: a bad checkpoint leaves no workdir
    checked = policy_source.check(config, self.task)
    policy_source.check_fits(config, self.task, checked)  # episodes and the batch fit
    self.rundir = RunDir(
      workdir, config, reopen=reopen
    )  # locks it: a busy workdir is refused before any write
    try:
      self._start(config, progress, checked)
    except BaseException as error:
      if self.role is not None and getattr(self, "_async", None) is None and not self._server:
        # across processes, before this side's link was made: tell the other side in one line
        message = str(error).splitlines()[0] if str(error) else ""
        remote_rollouts.GroupLink(config.schedule.rollout_timeout).fail(
          f"{self.role} (process {jax.process_index()}) failed starting: "
          f"{type(error).__name__}: {message}"
        )
      self.close()
      raise

  def close(self) -> None:
    """Stop the rollout worker (asynchronous RL) and release the workdir (idempotent)."""
    try:
      for side in ("_async", "_server"):
        if getattr(self, side, None) is not None:
          getattr(self, side).close()
    finally:
      self.rundir.close()

  def __enter__(self) -> "Trainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _start(self, config: RLConfig, progress: bool, checked) -> None:
    self._server = None  # the rollout side of device groups across processes
    if self.role is not None and self.rundir.checkpoints.latest_step() is not None:
      raise ValueError(
        f"{self.rundir.checkpoints.directory} holds a checkpoint: device groups across "
        "processes (RLConfig.rollout_devices) start fresh; use another --workdir"
      )
    if self.role == "rollout":  # this process only generates: the learner's side trains
      self.source = policy_source.load(config, self.task, checked=checked)
      self.tokenizer, self.model_cfg = self.source.tokenizer, self.source.model_cfg
      self.mesh, self.warmstart = None, policy_source.skipped_warm_start(self.task)
      base, _ = episodes.rollout_configs(config, self.task, self.source)
      rollout = config.arm_spec.rollout(base).replace(skew=config.rollout_skew)
      self.spec = StepSpec.of(config, self.model_cfg.num_layers)
      self._server = remote_rollouts.RolloutServer(
        self.spec,
        self.source.policy,
        rollout,
        self.task,
        self.tokenizer,
        groups=self.groups,
        timeout=config.schedule.rollout_timeout,
      )
      return
    self.mesh = make_mesh(*config.mesh) if np.prod(config.mesh) > 1 else None
    if self.groups is not None:  # the learner's mesh on its own devices (also 1 x 1 x 1)
      self.mesh = make_mesh(*config.mesh, devices=self.groups[1])
    # The preset with the character tokenizer, or a checkpoint with its own (policy_source);
    # a checkpoint's policy is read onto the learner's mesh shard by shard.
    self.source = policy_source.load(config, self.task, checked=checked, mesh=self.mesh)
    self.tokenizer, self.model_cfg = self.source.tokenizer, self.source.model_cfg
    policy = self.source.policy
    if self.mesh is not None:  # placed before the warm start: its save is then multi-host safe
      shard_model(policy, self.mesh)  # (a no-op for a policy read onto the mesh)
    base, self._greedy = episodes.rollout_configs(config, self.task, self.source)
    if policy_source.warm_start(config, self.task):
      self.warmstart = self.rundir.warm_start(
        policy, self.task, self.tokenizer, greedy=self._greedy, mesh=self.mesh, progress=progress
      )
    else:
      self.warmstart = policy_source.skipped_warm_start(self.task)
    staleness = async_rollouts.check_staleness(config)
    slots = async_rollouts.initial_slots(policy, staleness) if staleness else None
    initial = step_lib.init_state(config, policy, mesh=self.mesh)
    self.state: RLState = self.rundir.restore(initial, slots)
    self.spec = StepSpec.of(config, self.model_cfg.num_layers, self.mesh)
    # The arm's rollouts (only they: not the evaluation's) skewed by RLConfig.rollout_skew.
    self.sync = WeightSync()
    rollout = config.arm_spec.rollout(base).replace(skew=config.rollout_skew)
    self._engine = self.sync.add(RolloutEngine(policy, rollout, mesh=self.mesh), self.state.version)
    self._async = None  # asynchronous RL or device groups: the ring, the worker, its engine
    if staleness or self.groups is not None:
      rollouts = async_rollouts.AsyncRollouts
      if self.role == "learner":  # the batches come from the rollout processes
        rollouts = remote_rollouts.RemoteRollouts
      self._async = rollouts(
        self.spec,
        policy,
        self.state.version,
        slots or {},
        rollout,
        self.task,
        self.tokenizer,
        groups=self.groups,
        timeout=config.schedule.rollout_timeout,
      )
    # each once: the whole held-out split where the task lists it (chain: 324), else
    # eval_size distinct problems
    self.eval_items = self.task.evaluation_items(
      data.eval_seed(config.seed), config.evaluation.eval_size
    )

  # The run's parts, as the scripts and tests read them.
  workdir = property(lambda self: self.rundir.path)
  metrics_path = property(lambda self: self.rundir.metrics_path)
  checkpoints = property(lambda self: self.rundir.checkpoints)
  policy = property(lambda self: self.state.policy)
  reference = property(lambda self: self.state.reference)
  step = property(lambda self: self.state.step)
  guided_layers = property(lambda self: self.spec.guided_layers)

  def _synced(self, engine: RolloutEngine) -> RolloutEngine:
    return self.sync(engine, self.state.policy, self.state.version)

  @property
  def engine(self) -> RolloutEngine:
    """The arm's rollout engine, holding the current policy's rollout weights."""
    return self._synced(self._engine)

  @functools.cached_property
  def eval_engines(self) -> dict[str, RolloutEngine]:
    """The greedy evaluation engines, FP4 and bf16, made when first used (a run with
    eval_every=0 never pays their weight packing)."""
    return {
      precision: self.sync.add(
        RolloutEngine(self.policy, self._greedy.replace(precision=precision), mesh=self.mesh),
        self.state.version,
      )
      for precision in ("fp4", "bf16")
    }

  def evaluate(self) -> dict:
    """Greedy reward on the fixed evaluation problems, in FP4 and in bf16."""
    if not self.eval_items:
      return {}
    engines = {name: self._synced(engine) for name, engine in self.eval_engines.items()}
    return episodes.evaluate(engines, self.task, self.tokenizer, self.eval_items)

  def train_step(self) -> dict:
    """One RL step: collect (asynchronous RL: receive a batch generated ahead with older
    weights, `run.async_rollouts`) -> score -> update -> check (-> publish); its metrics."""
    step, spec, extra = self.state.step + 1, self.spec, {}
    start = time.time()
    if self._async is None:
      version = self.state.version
      collected = step_lib.collect(spec, self.engine, self.task, self.tokenizer, step, version)
      rollout_seconds, engine = time.time() - start, self._engine
    else:
      collected, rollout_seconds, extra = self._async.receive(self.state.version)
      engine = self._async.engine
    start = time.time()
    scored = step_lib.score(spec, self.state, collected, step)
    state, done = step_lib.update(spec, self.state, scored)
    step_lib.check_update(spec, step, done, self.rundir.last_good(), before=self.state.policy)
    train_seconds = time.time() - start
    metrics = step_lib.step_metrics(spec, step, collected, done, engine)
    if self._async is not None:
      metrics.update(extra, **self._async.version_split(step, collected))
      self._async.publish(state.policy)
      if self.groups is not None:
        metrics["async/publish_seconds"] = self._async.publish_seconds
    metrics.update(rollout_seconds=rollout_seconds, train_seconds=train_seconds)
    self.state = state
    return metrics

  def save(self) -> None:
    self.rundir.save(self.state, None if self._async is None else self._async.slots())

  def run(self) -> list[dict]:
    """Train until the schedule's steps; returns the metrics of the steps run now."""
    if self._server is not None:  # the rollout side across processes: it serves batches
      try:
        return self._server.run()
      finally:
        self._server.close()
    steps, every = self.config.schedule.steps, self.config.evaluation.eval_every
    history = []
    with contextlib.ExitStack() as stack:
      if self.mesh is not None:
        stack.enter_context(jax.set_mesh(self.mesh))
      if self.step == 0 and every:
        initial = self.evaluate()
        self.rundir.log({"step": 0, **initial})
        _warn_if_non_finite(initial)
      bar = tqdm(
        range(self.step, steps),
        desc=f"rl {self.config.arm}",
        disable=not self.progress,
        initial=self.step,
        total=steps,
      )
      stack.callback(self._stop_rollouts)
      for _ in bar:
        metrics = self._step()
        last = self.step == steps
        if every and (self.step % every == 0 or last):
          metrics.update(self.evaluate())
        self.rundir.log(metrics)
        history.append(metrics)
        bar.set_postfix(
          reward=f"{metrics['rewards/mean']:.2f}", k3=f"{metrics['mismatch/k3_kl']:.1e}"
        )
        checkpoint_every = self.config.schedule.checkpoint_every
        if checkpoint_every and (self.step % checkpoint_every == 0 or last):
          self.save()
    return history

  def _step(self) -> dict:
    """`train_step`; with a rollout worker beside it, a learner failure is said in one line
    naming the learner (the worker then stops with the run: `_stop_rollouts`)."""
    try:
      return self.train_step()
    except Exception as error:
      if self._async is not None and not isinstance(error, (RolloutWorkerError, TimeoutError)):
        where = (
          "" if self.groups is None else f" (devices {async_rollouts.device_ids(self.groups[1])})"
        )
        line = "learner%s failed at step %d: %s: %s; the rollout worker stops" % (
          where,
          self.step + 1,
          type(error).__name__,
          str(error).splitlines()[0] if str(error) else "",
        )
        logging.error("%s", line)
        self._async.failed(line)
      raise

  def _stop_rollouts(self) -> None:
    """The rollout worker stops when `run` returns or raises (a later step starts another
    from the ring's latest version)."""
    if self._async is not None:
      self._async.close()


def _warn_if_non_finite(evaluation: dict) -> None:
  """Say so when the initial evaluation is NaN: the logits of the weights the run starts
  from are not finite (a step that then fails is no fault of the learning rate)."""
  rewards = {k: v for k, v in evaluation.items() if k.startswith("eval/reward_")}
  if any(not math.isfinite(v) for k, v in rewards.items() if not k.endswith("_se")):
    logging.warning(
      "the initial evaluation is non-finite (%s): before any update, the starting "
      "policy's logits hold NaN or Inf (its weights, or their FP4 rollout copy, are not "
      "finite); no learning rate fixes that",
      ", ".join(f"{k}={v}" for k, v in rewards.items() if not k.endswith("_se")),
    )
