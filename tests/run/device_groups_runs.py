"""The runs `test_device_groups.py` asserts on, in one process with 8 CPU devices (set before
JAX starts): python device_groups_runs.py OUT.json WORKDIR.

Every run: the tiny preset, batches of 8, 4 tokens; device groups 4 + 4 (the rollout
group devices 0-3, the learner's (4, 1, 1) mesh devices 4-7). It writes what each run did
(metrics, parameters compared, devices seen, errors, seconds) as JSON; the tests judge.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=8 "
  + os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
).strip()

import json  # noqa: E402
import logging  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from trace_jax.rl import pipeline  # noqa: E402
from trace_jax.rl import step as step_lib  # noqa: E402
from trace_jax.rl.config import RLConfig  # noqa: E402
from trace_jax.run.rundir import read_metrics  # noqa: E402
from trace_jax.run.trainer import Trainer  # noqa: E402
from trace_jax.rl.metrics import TIMING_METRICS  # noqa: E402

TIMING = TIMING_METRICS


def config(**overrides):
  base = dict(
    task="arith",
    preset="tiny",
    steps=2,
    prompts_per_step=2,
    group_size=4,
    max_new_tokens=4,
    sft_warm_start=False,
    eval_every=0,
    checkpoint_every=0,
    prompt_bucket=32,
    tensorboard=False,
    mesh=(4, 1, 1),
    lr_decay="constant",
    rollout_devices=4,
  )
  return RLConfig.from_flat(**{**base, **overrides})


def params(trainer):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.policy)))


def same_params(a, b) -> bool:
  return all(
    np.array_equal(x, y, equal_nan=True) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def strip(metrics):
  """What the loop computed: no timing, no async/* bookkeeping."""
  return {k: v for k, v in metrics.items() if k not in TIMING and not k.startswith("async/")}


def device_ids(tree) -> list[int]:
  return sorted({d.id for leaf in jax.tree.leaves(tree) for d in leaf.devices()})


def run(cfg, workdir):
  with Trainer(cfg, workdir, progress=False) as trainer:
    history = trainer.run()
    return history, params(trainer), trainer


class _Lines(logging.Handler):
  def __init__(self):
    super().__init__()
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


def in_thread(target, timeout=240.0):
  """Run `target` in a thread; (error or None, seconds, whether it ended in time)."""
  outcome, start = {}, time.monotonic()

  def wrapped():
    try:
      target()
    except BaseException as error:  # noqa: BLE001 - reported
      outcome["error"] = error

  thread = threading.Thread(target=wrapped, daemon=True)
  thread.start()
  thread.join(timeout)
  return outcome.get("error"), time.monotonic() - start, not thread.is_alive()


def workers_alive() -> int:
  return sum(t.name == "rollout-worker" and t.is_alive() for t in threading.enumerate())


def describe(error):
  if error is None:
    return None
  cause = error.__cause__
  return {
    "type": type(error).__name__,
    "message": str(error),
    "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
  }


def main(out_path, root):
  out = {}
  # k = 0 with groups against the synchronous loop on a mesh of the same shape.
  sync_history, sync_params, _ = run(config(rollout_devices=0), f"{root}/sync")
  zero_history, zero_params, zero = run(config(), f"{root}/zero")
  out["k0"] = {
    "sync": [strip(m) for m in sync_history],
    "groups": [strip(m) for m in zero_history],
    "groups_async": [{k: v for k, v in m.items() if k.startswith("async/")} for m in zero_history],
    "same_params": same_params(sync_params, zero_params),
    "worker_thread": zero._async.worker is not None and zero._async.worker._thread is not None,
  }

  # k = 2, 4 steps, a checkpoint at step 2, the version split every step (on the learner's
  # ring of master weights): the uninterrupted run also records the queue's
  # depth after every put, the in-flight batches at every generation's start, and the
  # devices of what each side holds; the learner is slowed (the queue then fills).
  depths, in_flight, seen = [], [], {"learner": set(), "rollout": set()}

  class Recording(queue.Queue):
    def put(self, item, block=True, timeout=None):
      super().put(item, block, timeout)
      depths.append(self.qsize())

  original_queue, original_next = pipeline.queue, pipeline.RolloutWorker.next
  pipeline.queue = types.SimpleNamespace(Queue=Recording, Empty=queue.Empty, Full=queue.Full)
  workers = []

  def slow_next(self, timeout=None):
    if self not in workers:
      workers.append(self)
    time.sleep(0.4)
    return original_next(self, timeout)

  pipeline.RolloutWorker.next = slow_next
  collect, score = step_lib.collect, step_lib.score

  def recording_collect(spec, engine, task, tokenizer, step, version=0):
    if workers:  # batches generated but not received, this one included
      in_flight.append(step - workers[-1].next_batch)
    seen["rollout"].update(device_ids(engine.params))
    collected = collect(spec, engine, task, tokenizer, step, version)
    seen["rollout"].update(device_ids((collected.example, collected.guidance)))
    return collected

  def recording_score(spec, state, collected, step):
    seen["learner"].update(device_ids((collected.example, collected.guidance)))
    seen["learner"].update(device_ids(collected.rollout))
    return score(spec, state, collected, step)

  step_lib.collect, step_lib.score = recording_collect, recording_score
  cfg = config(steps=4, max_staleness=2, checkpoint_every=2, version_diag_every=1)
  try:
    straight_history, straight_params, straight = run(cfg, f"{root}/straight")
  finally:
    pipeline.queue, pipeline.RolloutWorker.next = original_queue, original_next
    step_lib.collect, step_lib.score = collect, score
  a = straight._async
  out["queue"] = {"bound": cfg.schedule.max_staleness + 1, "depths": depths, "in_flight": in_flight}
  out["devices"] = {
    "rollout_group": [d.id for d in a.groups[0]],
    "learner_group": [d.id for d in a.groups[1]],
    "policy": device_ids(nnx.state(straight.policy)),
    "opt": device_ids(nnx.state(straight.state.opt)),
    "master_ring": device_ids([a.ring.get(v) for v in a.ring.versions]),
    "rollout_ring": device_ids([a.rollout_ring.get(v)[1] for v in a.rollout_ring.versions]),
    "rollout_ring_versions": list(a.rollout_ring.versions),
    "engine": device_ids(a.engine.params),
    "seen_by_rollout": sorted(seen["rollout"]),
    "seen_by_learner": sorted(seen["learner"]),
    "logged": [(m["async/rollout_devices"], m["async/learner_devices"]) for m in straight_history],
    "publish_seconds": [m["async/publish_seconds"] for m in straight_history],
    "version_k3": [m["mismatch/version_k3"] for m in straight_history],
  }

  # Resume mid-pipeline: 2 steps, then a new Trainer continues to 4.
  run(cfg.replace(steps=2), f"{root}/resumed")
  with Trainer(cfg, f"{root}/resumed", progress=False) as resumed:
    versions = list(resumed._async.ring.versions), list(resumed._async.rollout_ring.versions)
    resumed.run()
    resumed_params = params(resumed)
  metrics = read_metrics(f"{root}/resumed")
  out["resume"] = {
    "restored_versions": versions,
    "steps": [m["step"] for m in metrics],
    "gaps": [m["async/version_gap"] for m in metrics],
    "straight_gaps": [m["async/version_gap"] for m in straight_history],
    "same_metrics": [strip(m) for m in metrics] == [strip(m) for m in straight_history],
    "same_params": same_params(resumed_params, straight_params),
  }

  # A failing worker on either side, and a hung one: each stops the run, without a hang.
  lines = _Lines()
  logging.getLogger().addHandler(lines)
  failures = {}

  collect, update = step_lib.collect, step_lib.update

  def rollout_fails(at_step, error=None, sleep=0.0):
    """collect, raising `error` (or sleeping `sleep` seconds first) at step `at_step`."""

    def broken(spec, engine, task, tokenizer, step, version=0):
      if step == at_step:
        if error is not None:
          raise error
        time.sleep(sleep)
      return collect(spec, engine, task, tokenizer, step, version)

    return broken

  cases = {
    "rollout": ("collect", rollout_fails(3, OSError("rollout host lost")), {}),
    "hung": ("collect", rollout_fails(2, sleep=8.0), {"rollout_timeout": 2.0}),
  }

  def learner_fails(spec, state, scored):
    if state.step + 1 == 2:
      raise OSError("learner device lost")
    return update(spec, state, scored)

  cases["learner"] = ("update", learner_fails, {})
  for name, (what, fake, extra) in cases.items():
    setattr(step_lib, what, fake)
    lines.lines.clear()
    workdir = f"{root}/fail_{name}"
    cfg = config(steps=4, max_staleness=2, **extra)
    try:
      error, seconds, ended = in_thread(lambda: run(cfg, workdir))
    finally:
      step_lib.collect, step_lib.update = collect, update
    time.sleep(0.2)  # a closed worker's thread ends within its poll
    failures[name] = {
      "error": describe(error),
      "seconds": seconds,
      "ended": ended,
      "workers_alive": workers_alive(),
      "steps": [m["step"] for m in read_metrics(workdir)],
      "log": [line for line in lines.lines if "fail" in line],
    }
  out["failures"] = failures
  logging.getLogger().removeHandler(lines)

  with open(out_path, "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
