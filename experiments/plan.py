"""Memory planner: bytes per device of an RL run before renting the devices.

  python experiments/plan.py --preset=qwen3_30b_a3b --mesh=8,8,1 --batch=256 --context=8192
  python experiments/plan.py --preset=qwen3_5_35b_a3b --mesh=8,8,1 --batch=256 --context=32768
  python experiments/plan.py --preset=all --mesh=8,8,1      # every published preset

Prints, per device of the (data, expert, model) mesh: master weights, optimizer state,
gradients, FP4 rollout weights, KV cache (bf16 and FP4) or recurrent state, guidance, the
activations of one training micro-batch with and without per-layer remat, and whether each
phase fits an H200 (141 GB). Everything is computed from `jax.eval_shape` / abstract traces
and the real shardings (`trace_jax.plan`); no device or weight is touched.
"""

from absl import app, flags

from trace_jax.model.config import PRESETS, get_preset
from trace_jax import plan as plan_lib
from trace_jax.utils import flags as config_flags

PUBLISHED = ("qwen3_30b_a3b", "qwen3_5_35b_a3b", "mixtral_8x7b", "olmoe_1b_7b")
_PRESET = flags.DEFINE_string(
  "preset", "qwen3_30b_a3b", f"Model preset, or 'all' for {', '.join(PUBLISHED)}."
)
# One flag per PlanConfig field (--activations too), its default and help.
_CONFIG = config_flags.define_flags(plan_lib.PlanConfig)


def main(argv):
  del argv
  names = PUBLISHED if _PRESET.value == "all" else (_PRESET.value,)
  try:
    config = config_flags.from_flags(plan_lib.PlanConfig, _CONFIG)
    cfgs = [get_preset(name) for name in names]
  except ValueError as e:
    raise app.UsageError(f"{e} (presets: {sorted(PRESETS)})") from e
  for name, cfg in zip(names, cfgs):
    try:
      rows = plan_lib.plan(cfg, config)
    except ValueError as e:  # e.g. a mesh axis that does not divide a dimension
      print(f"{name}: cannot place on mesh {config.mesh}: {e}\n")
      continue
    print(plan_lib.format_table(name, config, rows))
    print()


if __name__ == "__main__":
  app.run(main)
