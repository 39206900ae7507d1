"""The memory planner (`trace_jax.plan`) beside XLA's compiled programs, on a real mesh.

Compiles, from abstract shapes and without weights, the two programs a run's phases are:

  update   the learner's step as `Trainer.train_step` runs it (`rl.programs.train_step`, the
           function `rl.step.update` calls), with the trace arm's static arguments
           (`StepSpec.of`: guided at the arm's layers, routing replay, recording, fused),
           on one micro-batch: the policy and Adam's state placed by `model.sharding`'s
           rules, the trajectories batch over "data", the guidance by `guidance_specs`;
  rollout  the rollout engine's generate (`rollout.decode.generate_program`: prefill of the prompt,
           then the decode loop over the KV cache), with the trace arm's rollout settings
           (`Arm.rollout`) and the FP4 rollout weights placed by `rollout_param_shardings`.

and reads each one's `memory_analysis()` per device (arguments, outputs, aliased outputs,
temporaries, generated code) and the bytes its collectives move (`collective_bytes`). The
mesh must be made of real devices (on CPU: `--xla_force_host_platform_device_count`, set
before jax starts).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from trace_jax import plan as plan_lib
from trace_jax.model import sharding
from trace_jax.model.config import ModelConfig
from trace_jax.model.transformer import Transformer
from trace_jax.rl import programs
from trace_jax.rl import optimizer as optimizer_lib
from trace_jax.rl import step as step_lib
from trace_jax.rl.config import RLConfig
from trace_jax.rollout import decode as decode_lib
from trace_jax.rollout.config import RolloutConfig, SamplingConfig
from trace_jax.rollout.params import quantize_params

FIELDS = ("argument", "output", "alias", "temp", "code")


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One compiled program's bytes per device (`memory_analysis`) and its compile seconds."""

  argument: int
  output: int
  alias: int  # outputs that reuse a donated argument's buffer
  temp: int
  code: int  # generated code
  seconds: float
  collectives: dict = dataclasses.field(default_factory=dict)  # `collective_bytes`

  @property
  def peak(self) -> int:
    """Arguments, outputs not aliased to them and temporaries: the program's footprint."""
    return self.argument + self.output - self.alias + self.temp

  @classmethod
  def of(cls, compiled, seconds: float) -> "Compiled":
    m = compiled.memory_analysis()
    return cls(
      argument=int(m.argument_size_in_bytes),
      output=int(m.output_size_in_bytes),
      alias=int(m.alias_size_in_bytes),
      temp=int(m.temp_size_in_bytes),
      code=int(m.generated_code_size_in_bytes),
      seconds=seconds,
      collectives=collective_bytes(compiled.as_text()),
    )


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
_COLLECTIVE = re.compile(
  r"= (\([^=]*?\)|[a-z][a-z0-9]*\[[0-9,]*\]\S*) (" + "|".join(COLLECTIVES) + r")\("
)
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes of the results of each kind of collective in a compiled (partitioned) program's
  text, per device, {kind: bytes} over `COLLECTIVES` (synchronous ops, as XLA:CPU emits
  them; a tuple result counts each array, tokens none). Each op counts once: one in a loop's body (the
  scan over layers, the decode loop) once, not once per trip, so compare programs of one
  structure."""
  out = dict.fromkeys(COLLECTIVES, 0)
  for result, kind in _COLLECTIVE.findall(hlo_text):
    for dtype, dims in _ARRAY.findall(result):
      width = re.match(r"[a-z]+(\d+)", "pred8" if dtype == "pred" else dtype)
      if width:  # not a token
        elements = math.prod(int(d) for d in dims.split(",") if d)
        out[kind] += math.ceil(elements * int(width.group(1)) / 8)
  return out


def _placed(tree, shardings):
  """`tree`'s abstract leaves as ShapeDtypeStructs carrying `shardings` (same structure)."""
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    tree,
    shardings,
    is_leaf=lambda x: isinstance(x, NamedSharding),
  )


def _with_state(module, state):
  nnx.update(module, state)
  return module


def rl_config(config: plan_lib.PlanConfig) -> RLConfig:
  """The trace arm's run on the plan's mesh and FP4 scheme, bf16 activations."""
  return RLConfig(arm="trace", mesh=config.mesh, fp4=config.fp4, compute_dtype="bfloat16")


def micro_rows(config: plan_lib.PlanConfig) -> int:
  """Sequences of one training micro-batch (global)."""
  return config.micro_batch or config.mesh[0]


def compile_update(cfg: ModelConfig, config: plan_lib.PlanConfig, mesh) -> Compiled:
  """`rl.programs.train_step` compiled for one micro-batch of `micro_rows(config)` sequences of
  `config.context` slots on `mesh`, as `rl.step.update` calls it for the trace arm."""
  start = time.time()
  compiled = update_program(cfg, config, mesh)
  return Compiled.of(compiled, time.time() - start)


def update_program(cfg: ModelConfig, config: plan_lib.PlanConfig, mesh):
  """The XLA executable `compile_update` measures (its `output_shardings`, `as_text()`)."""
  cfg = cfg.replace(dtype="bfloat16")
  rl = rl_config(config)
  spec = step_lib.StepSpec.of(rl, cfg.num_layers, mesh)
  policy = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  tx = optimizer_lib.run_optimizer(rl, cfg.scan_layers)
  opt = nnx.eval_shape(lambda: nnx.Optimizer(Transformer(cfg, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param))
  opt_shardings = sharding.optimizer_shardings(opt, policy, mesh)
  policy = _with_state(policy, _placed(nnx.state(policy), sharding.param_shardings(policy, mesh)))
  opt = _with_state(opt, _placed(nnx.state(opt), opt_shardings))
  rows, slots = micro_rows(config), config.context

  def batch(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape)))

  example = step_lib.TrainExample(
    tokens=batch((rows, slots), jnp.int32),
    positions=batch((rows, slots), jnp.int32),
    mask=batch((rows, slots), bool),
    response_mask=batch((rows, slots), bool),
    rollout_logp=batch((rows, slots), jnp.float32),
    advantages=batch((rows,), jnp.float32),
  )
  guidance = None
  if rl.arm_spec.guidance != "none" or rl.arm_spec.routing_replay:
    captured = plan_lib.PlanConfig(
      mesh=config.mesh,
      batch=rows,
      context=slots,
      fp4=config.fp4,
      guidance=rl.arm_spec.guidance,
      guided_layers=rl.arm_spec.guided_layers,
    )
    guidance = plan_lib.abstract_guidance(cfg, captured, config.fp4)
    specs = sharding.guidance_specs(guidance, mesh)
    guidance = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
      guidance,
      specs,
    )
  with jax.set_mesh(mesh):
    return programs.train_step.lower(
      policy,
      opt,
      example,
      guidance,
      None,
      loss_config=rl.loss_config,
      fused=spec.fused,
      record=spec.arm.measured,
      mesh=mesh,
      **spec.static,
    ).compile()


def rollout_config(config: plan_lib.PlanConfig, prompt: int) -> RolloutConfig:
  """The trace arm's rollout of `config.context` slots, `prompt` of them the prompt."""
  rl = rl_config(config)
  base = RolloutConfig(
    max_len=config.context,
    prefill_chunk=config.prefill_chunk,
    sampling=SamplingConfig(max_new_tokens=config.context - prompt),
    compute_dtype=rl.compute_dtype,
    fp4=rl.fp4,
  )
  return rl.arm_spec.rollout(base)


def compile_rollout(
  cfg: ModelConfig, config: plan_lib.PlanConfig, mesh, prompt: int, kernels: str = "xla"
) -> Compiled:
  """`rollout.decode.generate_program` compiled for `config.batch` prompts of `prompt` tokens
  decoded to `config.context` slots on `mesh`, with the statics a `RolloutEngine` of the
  trace arm's rollout makes (`kernels`: "xla" on CPU; a GPU run may take "pallas")."""
  start = time.time()
  compiled = rollout_program(cfg, config, mesh, prompt, kernels)
  return Compiled.of(compiled, time.time() - start)


def rollout_program(
  cfg: ModelConfig, config: plan_lib.PlanConfig, mesh, prompt: int, kernels: str = "xla"
):
  """The XLA executable `compile_rollout` measures (its `as_text()`: the largest buffers)."""
  if not 0 < prompt < config.context:
    raise ValueError(f"prompt={prompt} must lie in [1, context={config.context})")
  cfg = cfg.replace(dtype="bfloat16")
  rollout = rollout_config(config, prompt)
  st = decode_lib.Statics.of(rollout, cfg, kernels, mesh=mesh)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  dtype = jnp.dtype(rollout.compute_dtype)
  params = jax.eval_shape(lambda s: quantize_params(s, rollout.quant, dtype=dtype), state)
  params = _placed(params, sharding.rollout_param_shardings(params, mesh))
  rows = sharding.batch_sharding(mesh, 2)
  tokens = jax.ShapeDtypeStruct((config.batch, prompt), jnp.int32, sharding=rows)
  mask = jax.ShapeDtypeStruct((config.batch, prompt), bool, sharding=rows)
  key = jax.eval_shape(lambda: jax.random.key(0))
  per_row = sharding.batch_sharding(mesh, 1)
  sequence = jax.ShapeDtypeStruct((config.batch,), jnp.uint32, sharding=per_row)
  budget = jax.ShapeDtypeStruct((config.batch,), jnp.int32, sharding=per_row)
  with jax.set_mesh(mesh):
    return decode_lib.generate_program.lower(
      graphdef, params, tokens, mask, key, None, sequence, budget, st
    ).compile()


def trajectory_bytes(rows: int, slots: int) -> int:
  """The update's trajectories (`TrainExample`, fused: no old_logp): tokens and positions
  int32, mask and response mask bool, rollout log-probs float32 per slot, one float32
  advantage per sequence."""
  return rows * slots * (4 + 4 + 1 + 1 + 4) + rows * 4


def rollout_slot_bytes(rows: int, slots: int) -> int:
  """The rollout's per-slot buffers beside its cache and guidance: tokens and positions
  int32, prompt / response / env masks bool, log-probs and sampling log-probs float32, and
  one int32 finish reason per sequence."""
  return rows * slots * (4 + 4 + 1 + 1 + 1 + 4 + 4) + rows * 4


def planner_programs(cfg: ModelConfig, config: plan_lib.PlanConfig, rows: dict, prompt: int):
  """The planner's figures per device for what the two compiled programs hold:
  {"update" | "rollout": {"argument", "output", "temp"}} (outputs not aliased to a donated
  argument). Built from `plan` rows and the shapes of the batch arrays the planner leaves
  out (`trajectory_bytes`, `rollout_slot_bytes`).

  update: arguments master + Adam + the guidance of one micro-batch + its trajectories;
  outputs the training-path records + log pi_old and entropy (float32 per slot);
  temporaries gradients + activations (remat or not as `cfg.remat`) + softmax and LM head
  gradients.
  rollout: arguments the FP4 rollout weights + the prompt (int32 tokens, bool mask);
  outputs KV cache + recurrent state + the guidance the trace arm's rollout captures (its
  own guided layers: every layer where the arm is measured) + the slot buffers;
  temporaries the rollout working set (`plan.rollout_working_bytes`)."""
  cfg = cfg.replace(dtype="bfloat16")
  mesh = plan_lib.abstract_mesh(*config.mesh)
  data = config.mesh[0]
  rl = rl_config(config)
  micro = micro_rows(config)
  micro_plan = dataclasses.replace(
    config,
    batch=micro,
    guidance=rl.arm_spec.guidance,
    guided_layers=rl.arm_spec.guided_layers,
  )
  micro_guidance = plan_lib.guidance_bytes(cfg, micro_plan, mesh, config.fp4)
  activations = rows["activations (remat)" if cfg.remat else "activations (no remat)"]
  update = {
    "argument": rows["master weights (f32)"]
    + rows["optimizer state (Adam)"]
    + micro_guidance
    + trajectory_bytes(micro, config.context) / data,
    "output": rows["training-path records"] + 2 * micro * config.context * 4 / data,
    "temp": rows["gradients (f32)"]
    + activations
    + rows["softmax gradients"]
    + rows["LM head gradients"],
  }
  rollout_cfg = rollout_config(config, prompt)
  captured = dataclasses.replace(
    config, guidance=rollout_cfg.guidance, guided_layers=rollout_cfg.guided_layers
  )
  kv = "KV cache (FP4)" if rollout_cfg.quant is not None else "KV cache (bf16)"
  rollout = {
    "argument": rows["FP4 rollout weights"] + config.batch * prompt * 5 / data,
    "output": rows[kv]
    + rows["recurrent state"]
    + plan_lib.guidance_bytes(cfg, captured, mesh, config.fp4)
    + rollout_slot_bytes(config.batch, config.context) / data,
    "temp": rows["rollout working set"],
  }
  return {"update": update, "rollout": rollout}


def format_comparison(
  name: str, config: plan_lib.PlanConfig, rows: dict, planned: dict, compiled: dict
) -> str:
  """A markdown table, per program, of the planner's bytes per device beside the compiled
  program's (`Compiled`), their ratio, and whether each phase fits the device: the compiled
  program's footprint plus what the phase keeps resident outside it (the planner's figures:
  the FP4 rollout weights during the update, master weights and Adam during the rollout)."""
  gb = plan_lib.GB
  limit = config.device_bytes
  lines = [
    f"{name}: planner vs compiled (XLA memory_analysis), bytes per device, mesh {config.mesh}",
    "",
    "| program | item | planner GB | compiled GB | compiled / planner | compiled bytes |",
    "| --- | --- | ---: | ---: | ---: | ---: |",
  ]

  def line(program, item, plan_value, compiled_value):
    ratio = "—" if not plan_value else f"{compiled_value / plan_value:.3f}"
    planned_gb = "—" if plan_value is None else f"{plan_value / gb:,.3f}"
    lines.append(
      f"| {program} | {item} | {planned_gb} | {compiled_value / gb:,.3f} | {ratio} "
      f"| {compiled_value} |"
    )

  outside = {
    "update": rows["FP4 rollout weights"],
    "rollout": rows["master weights (f32)"] + rows["optimizer state (Adam)"],
  }
  verdicts = []
  for program in ("update", "rollout"):
    p, c = planned[program], compiled[program]
    line(program, "arguments", p["argument"], c.argument)
    line(program, "outputs (not aliased)", p["output"], c.output - c.alias)
    line(program, "aliased outputs (donated)", None, c.alias)
    line(program, "temporaries", p["temp"], c.temp)
    line(program, "generated code", None, c.code)
    plan_peak = p["argument"] + p["output"] + p["temp"]
    line(program, "program peak", plan_peak, c.peak)
    line(
      program,
      "phase peak (+ resident outside)",
      plan_peak + outside[program],
      c.peak + outside[program],
    )
    fits = lambda v: "fits" if v <= limit else "does NOT fit"  # noqa: E731
    verdicts.append(
      f"{program}: planner {fits(plan_peak + outside[program])}, "
      f"compiled {fits(c.peak + outside[program])}"
    )
  lines.append("")
  lines.append(f"H200 ({limit / gb:.0f} GB): " + "; ".join(verdicts))
  seconds = ", ".join(f"{k} {v.seconds:.1f} s" for k, v in compiled.items())
  lines.append(f"compile seconds: {seconds}")
  for program, c in compiled.items():
    kinds = ", ".join(f"{k} {v / gb:,.3f}" for k, v in c.collectives.items() if v)
    lines.append(
      f"{program} collectives per device (GB, each op once): "
      f"{sum(c.collectives.values()) / gb:,.3f} ({kinds or 'none'})"
    )
  return "\n".join(lines)
