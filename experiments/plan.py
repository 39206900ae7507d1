"""Memory planner: bytes per device of an RL run before renting the devices.

  python experiments/plan.py --preset=qwen3_30b_a3b --mesh=8,8,1 --batch=256 --context=8192
  python experiments/plan.py --preset=qwen3_5_35b_a3b --mesh=8,8,1 --batch=256 --context=32768
  python experiments/plan.py --preset=all --mesh=8,8,1      # every published preset
  python experiments/plan.py --preset=qwen3_30b_a3b --mesh=8,8,1 --check   # beside XLA

Prints, per device of the (data, expert, model) mesh: master weights, optimizer state,
gradients, FP4 rollout weights, KV cache (bf16 and FP4) or recurrent state, guidance, the
activations of one training micro-batch with and without per-layer remat, and whether each
phase fits an H200 (141 GB). Everything is computed from `jax.eval_shape` / abstract traces
and the real shardings (`trace_jax.plan`); no device or weight is touched.

--check also compiles the two programs of a run, from abstract shapes and without weights,
on a mesh of fake CPU devices (the script re-runs itself with
--xla_force_host_platform_device_count when this process has too few devices): the
learner's update as the trainer runs it and the rollout's generate, both the trace arm's
(`trace_jax.run.memory_check`), and prints the planner's bytes per device beside XLA's
`memory_analysis` of each (arguments, outputs, temporaries, generated code), with the
ratio and which phases fit. --layers keeps the preset's widths at fewer layers (the
compile time grows with depth).
"""

import math
import os
import subprocess
import sys

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
_CHECK = flags.DEFINE_bool(
  "check", False, "Also compile the update and the rollout on fake devices and compare."
)
_LAYERS = flags.DEFINE_integer(
  "layers", 0, "Plan (and check) the preset at this many layers, its widths kept; 0: its own."
)
_PROMPT = flags.DEFINE_integer(
  "check_prompt", 0, "--check: prompt tokens of the compiled rollout; 0: a quarter of context."
)
_REMAT = flags.DEFINE_enum(
  "remat",
  "preset",
  ("preset", "on", "off"),
  "Per-layer remat of the training forward (--check compiles the update so): the preset's, on "
  "or off.",
)
_SCAN = flags.DEFINE_enum(
  "scan_layers",
  "preset",
  ("preset", "on", "off"),
  "Alike layers of the training forward under one scan (--check compiles the update so): the "
  "preset's, on or off.",
)
_DEVICES_ENV = "_TRACE_JAX_PLAN_CHECK_CHILD"


def with_layers(cfg, layers: int):
  """`cfg` at `layers` layers (its widths kept; layer types and dense layers cut to them)."""
  if layers == 0:
    return cfg
  if layers < 0:
    raise ValueError(f"--layers={layers} must be >= 0 (0: the preset's own depth)")
  return cfg.replace(
    num_layers=layers,
    layer_types=tuple(cfg.layer_types[:layers]),
    dense_layers=tuple(i for i in cfg.dense_layers if i < layers),
  )


def _rerun_with_devices(count: int) -> int:
  """Run this script again in a subprocess with `count` fake CPU devices; its exit code."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", **{_DEVICES_ENV: "1"})
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
  ).strip()
  return subprocess.run(
    [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env
  ).returncode


def check(name: str, cfg, config, rows) -> str:
  """The planner beside the compiled update and rollout (`memory_check`), as a table."""
  from trace_jax.model.sharding import make_mesh  # noqa: PLC0415 - only with --check
  from trace_jax.run import memory_check  # noqa: PLC0415

  mesh = make_mesh(*config.mesh)
  prompt = _PROMPT.value or max(1, config.context // 4)
  compiled = {
    "update": memory_check.compile_update(cfg, config, mesh),
    "rollout": memory_check.compile_rollout(cfg, config, mesh, prompt),
  }
  planned = memory_check.planner_programs(cfg, config, rows, prompt)
  table = memory_check.format_comparison(name, config, rows, planned, compiled)
  return (
    f"{table}\nupdate: {memory_check.micro_rows(config)} sequences of {config.context} slots, "
    f"remat {'on' if cfg.remat else 'off'}, scan_layers {'on' if cfg.scan_layers else 'off'}; "
    f"rollout: {config.batch} prompts of {prompt} "
    f"tokens decoded to {config.context} slots; {cfg.num_layers} layers"
  )


def main(argv):
  del argv
  names = PUBLISHED if _PRESET.value == "all" else (_PRESET.value,)
  try:
    config = config_flags.from_flags(plan_lib.PlanConfig, _CONFIG)
    cfgs = [with_layers(get_preset(name), _LAYERS.value) for name in names]
    if _REMAT.value != "preset":
      cfgs = [cfg.replace(remat=_REMAT.value == "on") for cfg in cfgs]
    if _SCAN.value != "preset":
      cfgs = [cfg.replace(scan_layers=_SCAN.value == "on") for cfg in cfgs]
  except ValueError as e:
    raise app.UsageError(f"{e} (presets: {sorted(PRESETS)})") from e
  if _CHECK.value:
    import jax  # noqa: PLC0415

    needed = math.prod(config.mesh)
    if jax.device_count() < needed:
      if os.environ.get(_DEVICES_ENV):
        raise app.UsageError(f"--check: {jax.device_count()} devices, the mesh needs {needed}")
      sys.exit(_rerun_with_devices(needed))
  for name, cfg in zip(names, cfgs):
    try:
      rows = plan_lib.plan(cfg, config)
    except ValueError as e:  # e.g. a mesh axis that does not divide a dimension
      print(f"{name}: cannot place on mesh {config.mesh}: {e}\n")
      continue
    print(plan_lib.format_table(name, config, rows))
    print()
    if _CHECK.value:
      print(check(name, cfg, config, rows))
      print()


if __name__ == "__main__":
  app.run(main)
