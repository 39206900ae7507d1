"""Asynchronous RL and device groups against the synchronous loop: RL steps per second on
fake CPU devices.

  python experiments/bench_async.py                     # 8 fake devices, splits 0, 2, 4; k = 0, 1, 3
  python experiments/bench_async.py --devices=4 --splits=0,2 --staleness=0,2 --steps=6
  python experiments/bench_async.py --smoke --steps=4 --splits=0,2 --staleness=0,1

Each setting (split N, max_staleness k) runs the main job's step (chain, small preset,
8 problems x 16 samples, trace; --smoke: the tiny preset, 2 x 4 samples, 8 new tokens)
from a fresh policy (no warm start, no evaluation, no checkpoint) for --steps steps in a
process of its own, with XLA_FLAGS faking --devices CPU devices.

- Split 0: rollouts and the learner share the devices; the learner's batch is split over
  all of them (mesh data axis = --devices). k = 0 is the synchronous loop, k > 0 the
  rollout thread (`run.async_rollouts`) beside the learner.
- Split N > 0 (`RLConfig.rollout_devices = N`): the first N devices are the rollout group
  (N data-parallel replicas), the learner's mesh has data axis devices - N on the rest, or
  the largest divisor of the batch (and its minibatches) below that, the others idle (8
  devices, batch 128, split 2: data axis 4, 2 idle; the table says which). k = 0 is the
  synchronous loop on the two groups, k > 0 the rollout thread on its own group.

Per setting: steps/s counts the steps after the first 2 + max k (the compiles, and the
batches the rollout thread made ahead during them, drained): a short run that timed those
would credit asynchrony with the compile time. The learner's wait per step is the mean
`async/wait_seconds` (the time `receive` blocks for a batch: with k = 0 on groups that is
the inline rollout itself); the shared synchronous loop has no such metric and the learner
runs the rollout itself, so its wait is its rollout_seconds. The rollout's wait per step is
the mean `async/rollout_wait_seconds` (the rollout thread blocked on weights or a full
queue; n/a where there is no thread, k = 0). Publish seconds per update: the mean
`async/publish_seconds` (making the version's rollout weights on the learner's mesh and
putting them onto the rollout group, waited for; n/a where the devices are shared). Ratios
are to (split 0, k 0), the shared synchronous loop, measured in the same run; the fastest
synchronous row is named as well. --json_out keeps every row. A setting whose process
fails is listed as failed (in the JSON too) and the others still run: on CPU a shared-device
k > 0 setting can abort in XLA's in-process all-reduce (one run of split 0, k = 3 did,
stuck: the rollout thread's collectives and the learner's interleave on the same devices).

What a CPU can show: the fake devices are threads on this machine's cores (2 here), so the
two groups cannot run in parallel in hardware; what a split shows is the plumbing's cost
(publishing and transferring weights, moving batches onto the learner's mesh, the queue's
waits), and asynchrony gains only what the rollout's single-threaded host work (dispatches,
tasks, rewards) leaves idle of the cores. What needs GPUs: the speed-up itself. With devices
of its own each group computes in parallel with the other, and the ratio approaches
(rollout + train) / max(rollout, train) per step less the publish time; which split
balances the two, and how the publish time grows with the model, are for a GPU run.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

_DEVICES = flags.DEFINE_integer("devices", 8, "Fake CPU devices (rollout group + learner).")
_STEPS = flags.DEFINE_integer(
  "steps", 14, "RL steps per setting (the first 2 + max k not timed: compiles, the queue)."
)
_STALENESS = flags.DEFINE_list("staleness", ["0", "1", "3"], "max_staleness values (0 first).")
_SPLITS = flags.DEFINE_list(
  "splits", ["0", "2", "4"], "Rollout devices per setting (0 first: shared devices)."
)
_SMOKE = flags.DEFINE_bool("smoke", False, "The tiny preset, 2 x 4 samples, 8 new tokens.")
_JSON_OUT = flags.DEFINE_string("json_out", "runs/bench_async.json", "Every row, as JSON.")
_CHILD = flags.DEFINE_string("child", None, "Internal: run one setting (JSON) and print JSON.")

SMOKE = dict(preset="tiny", prompts_per_step=2, group_size=4, max_new_tokens=8, prompt_bucket=32)


def _config(spec: dict):
  from trace_jax.rl.config import RLConfig

  return RLConfig.from_flat(
    steps=spec["steps"],
    max_staleness=spec["k"],
    mesh=(spec["data"], 1, 1),
    rollout_devices=spec["split"],
    sft_warm_start=False,
    eval_every=0,
    checkpoint_every=0,
    **(SMOKE if spec["smoke"] else {}),
  )


def _mean(history: list[dict], key: str) -> float | None:
  values = [m[key] for m in history if key in m]
  return sum(values) / len(values) if values else None


def _child(spec: dict) -> None:
  import time

  from trace_jax.run.trainer import Trainer

  config = _config(spec)
  stamps = []
  with tempfile.TemporaryDirectory() as workdir:
    with Trainer(config, workdir, progress=False) as trainer:
      step = trainer.train_step
      trainer.train_step = lambda: (step(), stamps.append(time.time()))[0]
      history = trainer.run()
  # Untimed: the first two steps (compiles) and max k more, over which the rollout thread's
  # batches made during the compiles drain: the same steps for every setting.
  skip = spec["skip"]
  timed, rest = stamps[skip - 1 :], history[skip:]  # from the end of step `skip`
  wait = _mean(rest, "async/wait_seconds")
  out = {
    "split": spec["split"],
    "k": spec["k"],
    "learner_data": spec["data"],
    "rollout_devices": history[-1].get("async/rollout_devices", ""),
    "learner_devices": history[-1].get("async/learner_devices", ""),
    "steps_per_second": (len(timed) - 1) / (timed[-1] - timed[0]),
    "rollout_seconds": _mean(rest, "rollout_seconds"),
    "train_seconds": _mean(rest, "train_seconds"),
    # the shared synchronous loop: the learner runs the rollout itself
    "learner_wait_seconds": _mean(rest, "rollout_seconds") if wait is None else wait,
    "learner_wait_source": "rollout_seconds" if wait is None else "async/wait_seconds",
    "rollout_wait_seconds": _mean(rest, "async/rollout_wait_seconds"),
    "publish_seconds": _mean(rest, "async/publish_seconds"),
  }
  print("RESULT " + json.dumps(out), flush=True)


def _learner_data(devices: int, split: int, batch: int, minibatch: int) -> int:
  """The learner's data axis: the largest divisor of the batch and the minibatch that fits
  the devices after the rollout group."""
  return max(d for d in range(1, devices - split + 1) if batch % d == 0 and minibatch % d == 0)


def _settings(ks: list[int], splits: list[int]) -> list[dict]:
  """Every setting's spec, each config checked (a ValueError naming the field) first."""
  skip = 2 + max(ks)
  base = _config({"steps": _STEPS.value, "k": 0, "data": 1, "split": 0, "smoke": _SMOKE.value})
  batch = base.batch
  minibatch = batch // base.schedule.minibatches
  specs = []
  for split in splits:
    if split >= _DEVICES.value:
      raise app.UsageError(
        f"--splits: split {split} leaves the learner none of the {_DEVICES.value} devices; "
        f"allowed: 0..{_DEVICES.value - 1}"
      )
    data = _learner_data(_DEVICES.value, split, batch, minibatch)
    for k in ks:
      spec = {
        "k": k,
        "split": split,
        "data": data,
        "steps": _STEPS.value,
        "skip": skip,
        "smoke": _SMOKE.value,
      }
      _config(spec)  # refuses a split the batch does not divide
      specs.append(spec)
  return specs


def _fmt(value: float | None, spec: str = ".2f") -> str:
  return "n/a" if value is None else format(value, spec)


def main(argv):
  del argv
  if _CHILD.value:
    _child(json.loads(_CHILD.value))
    return
  ks = [int(k) for k in _STALENESS.value]
  splits = [int(s) for s in _SPLITS.value]
  if ks[0] != 0 or min(ks) < 0:
    raise app.UsageError(f"--staleness={_STALENESS.value} must start with 0 (the baseline)")
  if splits[0] != 0 or min(splits) < 0:
    raise app.UsageError(f"--splits={_SPLITS.value} must start with 0 (the shared baseline)")
  skip = 2 + max(ks)
  if _STEPS.value < skip + 2:
    raise app.UsageError(
      f"--steps={_STEPS.value} must be >= {skip + 2}: 2 compile steps and max k = {max(ks)} "
      "untimed, then at least 2 timed"
    )
  import time

  from tqdm.auto import tqdm

  from trace_jax.utils import markdown_table

  specs = _settings(ks, splits)
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={_DEVICES.value}"}
  results = []
  for spec in tqdm(specs, desc="settings"):
    start = time.time()
    done = subprocess.run(
      [sys.executable, __file__, f"--child={json.dumps(spec)}"],
      env=env,
      capture_output=True,
      text=True,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
      failure = f"split={spec['split']} k={spec['k']} failed (exit {done.returncode})"
      if not results:  # the baseline
        raise RuntimeError(f"{failure}:\n{done.stderr[-3000:]}")
      print(f"{failure}; its row says so. stderr ends:\n{done.stderr[-1500:]}", file=sys.stderr)
      results.append({"split": spec["split"], "k": spec["k"], "failed": failure})
      continue
    results.append({**json.loads(lines[-1][len("RESULT ") :]), "wall_seconds": time.time() - start})
  base = results[0]["steps_per_second"]  # split 0, k 0: the shared synchronous loop
  failed = [r for r in results if "failed" in r]
  results = [r for r in results if "failed" not in r]
  best_sync = max((r for r in results if r["k"] == 0), key=lambda r: r["steps_per_second"])
  for r in results:
    r["vs_sync_shared"] = r["steps_per_second"] / base
    r["vs_fastest_sync"] = r["steps_per_second"] / best_sync["steps_per_second"]
  rows = [
    (
      "shared" if r["split"] == 0 else f"{r['split']}+{r['learner_data']}",
      "sync" if r["k"] == 0 else f"async k={r['k']}",
      f"{r['steps_per_second']:.3f}",
      f"{r['vs_sync_shared']:.2f}x",
      f"{r['vs_fastest_sync']:.2f}x",
      _fmt(r["rollout_seconds"]),
      _fmt(r["train_seconds"]),
      _fmt(r["learner_wait_seconds"]),
      _fmt(r["rollout_wait_seconds"]),
      _fmt(r["publish_seconds"], ".3f"),
    )
    for r in results
  ]
  header = (
    f"{_DEVICES.value} fake CPU devices, {os.cpu_count()} cores, {_STEPS.value} steps each, "
    f"steps {skip + 1}-{_STEPS.value} timed{', smoke sizes' if _SMOKE.value else ''}"
  )
  print(header)
  print(
    markdown_table(
      [
        "devices (rollout+learner)",
        "loop",
        "steps/s",
        "vs sync shared",
        "vs fastest sync",
        "rollout s/step",
        "train s/step",
        "learner wait s/step",
        "rollout wait s/step",
        "publish s/update",
      ],
      rows,
    )
  )
  print(
    f"sync shared: {base:.3f} steps/s; fastest synchronous: split {best_sync['split']} "
    f"({best_sync['steps_per_second']:.3f} steps/s, {best_sync['vs_sync_shared']:.2f}x). "
    "Learner wait: async/wait_seconds; the shared sync loop's is its rollout_seconds."
  )
  for r in failed:
    print(f"{r['failed']}: no row")
  if _JSON_OUT.value:
    os.makedirs(os.path.dirname(_JSON_OUT.value) or ".", exist_ok=True)
    with open(_JSON_OUT.value, "w") as f:
      json.dump({"header": header, "rows": results, "failed": failed}, f, indent=1)
    print(f"rows: {_JSON_OUT.value}")


if __name__ == "__main__":
  app.run(main)
