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

_D = plan_lib.PlanConfig()
PUBLISHED = ("qwen3_30b_a3b", "qwen3_5_35b_a3b", "mixtral_8x7b", "olmoe_1b_7b")
_PRESET = flags.DEFINE_string(
  "preset", "qwen3_30b_a3b", f"Model preset, or 'all' for {', '.join(PUBLISHED)}."
)
_MESH = flags.DEFINE_list("mesh", [str(m) for m in _D.mesh], "data,expert,model device counts.")
_BATCH = flags.DEFINE_integer("batch", _D.batch, "Rollout sequences in flight (global).")
_CONTEXT = flags.DEFINE_integer("context", _D.context, "Slots per sequence.")
_MICRO = flags.DEFINE_integer(
  "micro_batch",
  _D.micro_batch,
  "Training sequences per micro-batch (global); 0 = one per data shard.",
)
_FMT = flags.DEFINE_string("fmt", _D.fmt, "FP4 format: nvfp4 or mxfp4.")
_SITES = flags.DEFINE_string("fp4_sites", _D.fp4_sites, "FP4 scope: all or experts+kv.")
_GUIDANCE = flags.DEFINE_enum(
  "guidance", _D.guidance, ["none", "compact", "full"], "Guidance kind."
)
_DEVICE_GB = flags.DEFINE_float("device_gb", _D.device_bytes / 1e9, "Memory of one device, GB.")


def main(argv):
  del argv
  names = PUBLISHED if _PRESET.value == "all" else (_PRESET.value,)
  try:
    config = plan_lib.PlanConfig(
      mesh=tuple(int(m) for m in _MESH.value),
      batch=_BATCH.value,
      context=_CONTEXT.value,
      micro_batch=_MICRO.value,
      fmt=_FMT.value,
      fp4_sites=_SITES.value,
      guidance=_GUIDANCE.value,
      device_bytes=_DEVICE_GB.value * 1e9,
    )
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
