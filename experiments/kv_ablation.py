"""One arm with one setting changed, against the comparison it came from, paired seed by seed:
the KV-cache precision ablation of the long setting by default (trace with an FP4 KV cache,
the comparison's own cells on five seeds in long/seeds5, against trace with a bf16 KV cache).

  python experiments/compare_arms.py --name=long ...              # the comparison (see its doc)
  python experiments/compare_arms.py --results=experiments/results/arms/long --name=seeds5 \\
      --arms=fp4-qat,trace --seeds=0,1,2,3,4 ...                  # trace on five seeds
  python experiments/compare_arms.py --results=experiments/results/arms/long --name=kv_bf16 \\
      --arms=trace --kv_precision=bf16 --warmstarts_from=runs/arms/long ...   # the same flags
  python experiments/kv_ablation.py                              # the paired table and curves

Refuses two results whose settings differ in anything but --changed (default kv_precision),
or whose seeds' warm starts differ (their settings and length, from each run's summary). Writes
<variant>/ablation/: table.md (per task: each side's final evaluation, the paired
differences of the initial and final evaluations and of the gain, train reward, k3; then
each seed) and reward_curves.png, final_reward.png, k3.png of the two.
"""

import os

import matplotlib
from absl import app, flags

from trace_jax.rl.config import RLConfig
from trace_jax.studies import compare

_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
_BASE = flags.DEFINE_string(
  "base",
  os.path.join(_ROOT, "results", "arms", "long", "seeds5"),
  "The comparison's results (default: the long setting's trace on five seeds).",
)
_VARIANT = flags.DEFINE_string(
  "variant", os.path.join(_ROOT, "results", "arms", "long", "kv_bf16"), "The ablation's results."
)
_ARM = flags.DEFINE_string("arm", "trace", "The arm both ran.")
_CHANGED = flags.DEFINE_list("changed", ["kv_precision"], "The settings the variant changes.")
_LABEL = flags.DEFINE_string("label", "trace, bf16 KV", "The variant's name in the table.")


def check_settings(base: dict, variant: dict, changed) -> dict:
  """The overrides that differ between two comparisons; a ValueError naming them if any is
  not in `changed` (then the two are not an ablation of one setting)."""
  keys = set(base["overrides"]) | set(variant["overrides"])
  differ = {
    k: (base["overrides"].get(k), variant["overrides"].get(k))
    for k in sorted(keys)
    if base["overrides"].get(k) != variant["overrides"].get(k)
  }
  other = {k: v for k, v in differ.items() if k not in changed}
  if other:
    raise ValueError(
      f"--changed={list(changed)}: the two runs also differ in {other} (base, variant); "
      "rerun the variant with the comparison's flags, changing only those"
    )
  return differ


def _shown(differ: dict, cells, arm: str) -> str:
  """The changed settings as "name: base -> variant"; a flag the base left at its default
  is shown as the value its runs resolved it to (e.g. kv_precision fp4 under experts+kv)."""
  config = next((c.value("config") for c in cells if c.arm == arm), None)
  resolved = RLConfig.flat_dict(config) if config else {}  # older summaries: no config
  return ", ".join(
    f"{k}: {resolved.get(k, 'default') if a is None else a} -> {b}" for k, (a, b) in differ.items()
  )


def _recipe(cell) -> dict:
  """What made a run's warm start (its settings and length), not whether it was loaded."""
  return {k: v for k, v in (cell.value("warmstart") or {}).items() if k != "loaded"}


def main(argv):
  matplotlib.use("Agg")  # files, not windows: the script chooses the backend
  del argv
  base = compare.load_results(os.path.abspath(_BASE.value))
  variant = compare.load_results(os.path.abspath(_VARIANT.value))
  try:
    differ = check_settings(base.settings, variant.settings, _CHANGED.value)
    cells = compare.with_variant(base.cells, variant.cells, _ARM.value, _LABEL.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  index = compare.by_key(cells)
  starts = [
    (t, s)
    for (t, a, s), c in index.items()
    if a == _LABEL.value
    and (t, _ARM.value, s) in index
    and _recipe(c) != _recipe(index[(t, _ARM.value, s)])
  ]
  if starts:
    raise app.UsageError(
      f"--variant: its warm starts differ from the comparison's on (task, seed) {starts} "
      "(rerun it with --warmstarts_from=<the comparison's run directories>)"
    )
  pair = [c for c in cells if c.arm in (_ARM.value, _LABEL.value)]
  out = os.path.join(os.path.abspath(_VARIANT.value), "ablation")
  os.makedirs(out, exist_ok=True)
  title = f"{_LABEL.value} against {_ARM.value} ({_shown(differ, cells, _ARM.value)})"
  seeds = [
    f"- {t}, seed {s}: {_ARM.value} {c.value('initial_eval_reward'):.3f} -> {c.value():.3f}, "
    f"{_LABEL.value} {index[(t, _LABEL.value, s)].value('initial_eval_reward'):.3f} -> "
    f"{index[(t, _LABEL.value, s)].value():.3f}"
    for (t, a, s), c in sorted(index.items())
    if a == _ARM.value and (t, _LABEL.value, s) in index
  ]
  table = compare.ablation_markdown(pair, _ARM.value, _LABEL.value)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(f"# {title}\n\n{table}\n\nEach seed, start -> end:\n\n" + "\n".join(seeds) + "\n")
  compare.plot(pair, out, title)
  print(table)
  print("\n".join(seeds))
  print(f"\nwrote {out}/table.md, reward_curves.png, final_reward.png, k3.png")


if __name__ == "__main__":
  app.run(main)
