"""Asynchronous RL against the synchronous loop: RL steps per second on fake CPU devices.

  python experiments/bench_async.py                     # 8 fake devices, k = 0, 1, 3
  python experiments/bench_async.py --devices=1 --steps=6 --staleness=0,2

Each setting runs the main job's step (chain, small preset, 8 problems x 16 samples, trace)
from a fresh policy (no warm start, no evaluation, no checkpoint) for --steps steps in a
process of its own, with XLA_FLAGS faking --devices CPU devices and the learner's batch
split over them (mesh data axis = --devices). The rollout runs on the learner's devices in
the synchronous loop and, with k > 0, in the rollout thread (`run.async_rollouts`) beside
the learner. Each setting's ratio is to k = 0 measured in the same run. Steps/s counts the
steps after the first 2 + max k (the compiles, and the batches the rollout thread made ahead
during them, drained): a short run that timed those would credit asynchrony with the
compile time.

What it does and does not predict: on a CPU machine the fake devices share its cores, so
what async gains is what the rollout's host work (the sampling loop's dispatches, the
tasks and rewards, single-threaded) leaves idle of them; on a GPU cluster the rollout and
the learner hold devices of their own and the ratio approaches (rollout + train) /
max(rollout, train) per step.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

_DEVICES = flags.DEFINE_integer("devices", 8, "Fake CPU devices (the learner's data axis).")
_STEPS = flags.DEFINE_integer(
  "steps", 14, "RL steps per setting (the first 2 + max k not timed: compiles, the queue)."
)
_STALENESS = flags.DEFINE_list("staleness", ["0", "1", "3"], "max_staleness values (0 first).")
_CHILD = flags.DEFINE_string("child", None, "Internal: run one setting (JSON) and print JSON.")


def _child(spec: dict) -> None:
  import time

  import numpy as np

  from trace_jax.rl.config import RLConfig
  from trace_jax.run.trainer import Trainer

  config = RLConfig.from_flat(
    steps=spec["steps"],
    max_staleness=spec["k"],
    mesh=(spec["devices"], 1, 1),
    sft_warm_start=False,
    eval_every=0,
    checkpoint_every=0,
  )
  stamps = []
  with tempfile.TemporaryDirectory() as workdir:
    with Trainer(config, workdir, progress=False) as trainer:
      step = trainer.train_step
      trainer.train_step = lambda: (step(), stamps.append(time.time()))[0]
      history = trainer.run()
  # Untimed: the first two steps (compiles) and max k more, over which the rollout thread's
  # batches made during the compiles drain: the same steps for every setting.
  skip = spec["skip"]
  timed = stamps[skip - 1 :]  # from the end of step `skip`
  out = {
    "k": spec["k"],
    "steps_per_second": (len(timed) - 1) / (timed[-1] - timed[0]),
    "rollout_seconds": float(np.mean([m["rollout_seconds"] for m in history[skip:]])),
    "train_seconds": float(np.mean([m["train_seconds"] for m in history[skip:]])),
    "wait_seconds": float(np.mean([m.get("async/wait_seconds", 0.0) for m in history[skip:]])),
  }
  print("RESULT " + json.dumps(out), flush=True)


def main(argv):
  del argv
  if _CHILD.value:
    _child(json.loads(_CHILD.value))
    return
  ks = [int(k) for k in _STALENESS.value]
  if ks[0] != 0 or min(ks) < 0:
    raise app.UsageError(f"--staleness={_STALENESS.value} must start with 0 (the baseline)")
  skip = 2 + max(ks)
  if _STEPS.value < skip + 2:
    raise app.UsageError(
      f"--steps={_STEPS.value} must be >= {skip + 2}: 2 compile steps and max k = {max(ks)} "
      "untimed, then at least 2 timed"
    )
  from tqdm.auto import tqdm

  from trace_jax.utils import markdown_table

  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={_DEVICES.value}"}
  results = []
  for k in tqdm(ks, desc="settings"):
    spec = {"k": k, "steps": _STEPS.value, "devices": _DEVICES.value, "skip": skip}
    done = subprocess.run(
      [sys.executable, __file__, f"--child={json.dumps(spec)}"],
      env=env,
      capture_output=True,
      text=True,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
      raise RuntimeError(f"k={k} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    results.append(json.loads(lines[-1][len("RESULT ") :]))
  base = results[0]["steps_per_second"]
  rows = [
    (
      "sync" if r["k"] == 0 else f"async k={r['k']}",
      f"{r['steps_per_second']:.3f}",
      f"{r['steps_per_second'] / base:.2f}x",
      f"{r['rollout_seconds']:.2f}",
      f"{r['train_seconds']:.2f}",
      f"{r['wait_seconds']:.2f}",
    )
    for r in results
  ]
  print(
    f"{_DEVICES.value} fake CPU devices, {os.cpu_count()} cores, {_STEPS.value} steps each, "
    f"steps {skip + 1}-{_STEPS.value} timed"
  )
  print(
    markdown_table(
      ["loop", "steps/s", "vs sync", "rollout s/step", "train s/step", "learner wait s/step"],
      rows,
    )
  )


if __name__ == "__main__":
  app.run(main)
