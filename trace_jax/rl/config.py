"""The configuration of an RL run: one frozen dataclass per concern, composed.

  RLConfig                   the arm, the task, the seed, the rollout correction, the mesh
                             and the rollout's own devices
    source: Source           where the policy starts: a preset or a checkpoint, warm start,
                             prompt format
    sampling: Sampling       what a step samples: problems, group size, tokens, temperature
    loss: LossConfig         the GRPO loss (`rl.grpo`)
    schedule: Schedule       steps, learning rate and warmup, updates per step, checkpoints,
                             the rollouts' staleness (asynchronous RL)
    decoupled: DecoupledConfig  the behaviour -> proximal IS cap of asynchronous RL
                             (`rl.decoupled`)
    evaluation: Evaluation   the greedy evaluation's period and size
    fp4: QuantConfig         format, FP4 scope, activation format, KV cache (`model.quant`)

Validation reads only the values: no task is built and no file is read (the policy source
checks those before any work: `run.policy_source.preflight`). Every leaf has a flat name,
unique in the tree (`utils.flags`): the scripts' flags are derived from the fields, and a
saved config compares by flat name (`differences`), also one saved flat, before the sections.
"""

from __future__ import annotations

import dataclasses
import math
import os

from trace_jax import fp4
from trace_jax.model.config import COMPUTE_DTYPES, PRESETS
from trace_jax.model.quant import QuantConfig, check_run_scheme
from trace_jax.model.skew import check_amount
from trace_jax.rl.arms import ARMS, RUNNABLE, Arm, get_arm
from trace_jax.rl.decoupled import DecoupledConfig
from trace_jax.rl.grpo import CORRECTIONS, LossConfig
from trace_jax.tasks.registry import registered
from trace_jax.utils import flags
from trace_jax.utils.flags import knob

REWARD_CONTROLS = ("none", "shuffle", "shuffle_batch")
# What a run saved before a field existed ran with, where that is not the field's default
# now: a saved config that lacks the field reads as this value, not as today's default.
BEFORE_ADDED = {"sft_target": 0.0, "lr_decay": "constant", "prefill_chunk": 0, "mesh": [1, 1, 1]}
LR_DECAYS = ("constant", "cosine", "linear")
# Fields a resume may change: how the run computes or logs, not what it computes.
RESUMABLE_FIELDS = (
  "max_param_abs",
  "remat",
  "scan_layers",
  "prefill_chunk",
  "rollout_slots",
  "tensorboard",
  "wandb",
  "wandb_project",
  "rollout_timeout",
)
# The lowest sampling temperature a run takes (vLLM clamps to the same): every log-prob of the
# rollout and the training path is scaled by 1 / temperature, and below it a logit gap of
# under one nat between the two paths overflows float32's exp in the IS ratio and k3 (inf,
# then NaN). Greedy decoding is the evaluation's, not a temperature.
MIN_TEMPERATURE = 0.01
# The flags' help lists the arms and task kinds from their registries.
_ARMS_HELP = "The arm: %s. Evaluated by experiments/compare_arms.py, not run here: %s." % (
  "; ".join(f"{name} ({ARMS[name].describe()})" for name in RUNNABLE),
  "; ".join(f"{name} ({arm.describe()})" for name, arm in ARMS.items() if not arm.runnable),
)
_TASKS_HELP = (
  f"Task: {', '.join(t for t in registered() if ':' not in t)}; rg:NAME (a reasoning-gym "
  "task); or dataset:PATH (your problems: a .jsonl or .parquet file, docs/datasets.md)."
)


def _check(where: str, obj, names, ok, what: str) -> None:
  for name in names:
    if not ok(getattr(obj, name)):
      raise ValueError(f"{where}.{name}={getattr(obj, name)!r} {what}")


def _finite_positive(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _choose(where: str, name: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f"{where}.{name}={value!r} is not allowed; use one of {allowed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Source:
  """Where the policy and its tokenizer start (`run.policy_source`)."""

  preset: str = knob(
    "small", "Model preset (random initial weights, character tokenizer).", choices=PRESETS
  )
  hf_checkpoint: str = knob("", "Local HF checkpoint directory to start from, not --preset.")
  sft_warm_start: bool | None = knob(
    None, "SFT warm start (default: for a preset, not a checkpoint)."
  )
  sft_steps: int = knob(200, "Warm-start SFT steps (when the workdir has none).")
  sft_batch: int = knob(32, "Warm-start demonstrations per step.")
  sft_learning_rate: float = knob(3e-3, "Warm-start learning rate.")
  sft_target: float = knob(
    0.0,
    "Stop the warm start once its greedy FP4 reward on training problems reaches this "
    "(checked every 10 steps; 0: run all --sft_steps).",
  )
  prompt_format: str = knob(
    "auto",
    "chat (template), raw, or auto: chat with a checkpoint.",
    choices=("auto", "chat", "raw"),
  )
  system_prompt: str = knob("", "System turn of the chat template (needs --hf_checkpoint).")
  observation_role: str = knob("user", "Turn of multi-turn observations.", choices=("user", "tool"))
  chat_template_options: tuple = knob(
    (), "key=value template variables.", parse=flags.parse_bool_pairs
  )
  remat: bool = knob(False, "Recompute each block's activations in the backward pass.")
  scan_layers: bool = knob(
    True,
    "Run alike layers of the training path's calls under one scan (compiled once, not once "
    "per layer); off: the unrolled stack (gradients differ in the last bits).",
  )

  def __post_init__(self):
    where = "RLConfig"
    _choose(where, "preset", self.preset, sorted(PRESETS))
    if self.hf_checkpoint:  # the files are checked by the policy source, before any work
      object.__setattr__(self, "hf_checkpoint", os.path.abspath(self.hf_checkpoint))
    flags.check_choices(self, where)
    _choose(where, "sft_warm_start", self.sft_warm_start, (None, True, False))
    _check(where, self, ("sft_steps",), lambda v: v >= 0, "must be >= 0")
    _check(where, self, ("sft_batch",), lambda v: v >= 1, "must be >= 1")
    _check(where, self, ("sft_learning_rate",), _finite_positive, "must be a finite number > 0")
    _check(
      where,
      self,
      ("sft_target",),
      lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
      "must be a finite number >= 0 (0: no target)",
    )
    if not self.hf_checkpoint and self.prompt_format == "chat":
      raise ValueError(
        "RLConfig.prompt_format='chat' needs hf_checkpoint (the built-in character "
        "tokenizer has no chat template)"
      )
    if self.system_prompt and not self.chat:
      raise ValueError(
        f"RLConfig.system_prompt={self.system_prompt!r} needs a chat template "
        "(hf_checkpoint with prompt_format auto or chat)"
      )
    options = tuple(tuple(kv) for kv in self.chat_template_options)
    object.__setattr__(self, "chat_template_options", options)
    if any(len(kv) != 2 or not isinstance(kv[0], str) for kv in options):
      raise ValueError(f"RLConfig.chat_template_options={options!r} must be (name, value) pairs")

  @property
  def chat(self) -> bool:
    """Prompts through the checkpoint's chat template ("auto": with a checkpoint)."""
    return self.prompt_format == "chat" or (
      self.prompt_format == "auto" and bool(self.hf_checkpoint)
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """What a step samples."""

  prompts_per_step: int = knob(8, "Distinct problems per step.")
  group_size: int = knob(16, "Samples per problem (GRPO group).")
  max_new_tokens: int = knob(32, "Max tokens per turn.")
  temperature: float = knob(1.0, "Sampling temperature (and the tempered policy trained).")
  prompt_bucket: int = knob(0, "Pad prompts / observations to a multiple; 0: 16 (8 multi-turn).")
  prefill_chunk: int = knob(
    128,
    "Prompt slots per sequence the rollout's prefill feeds at once (a scan over chunks; "
    "0: the whole prompt in one call).",
  )
  rollout_slots: int = knob(
    0,
    "Decode slots of the rollout (a fixed pool refilled as sequences finish, a group's "
    "prompt prefilled once); 0: every sequence of a step at once.",
  )

  def __post_init__(self):
    names = ("prompts_per_step", "group_size", "max_new_tokens")
    _check("RLConfig", self, names, lambda v: v >= 1, "must be >= 1")
    if self.group_size == 1:
      raise ValueError(
        "RLConfig.group_size=1 gives every sample an advantage of 0 (r minus its group's "
        "mean, with one sample per group, with or without std_norm): no step would learn; "
        "use group_size >= 2"
      )
    names = ("prompt_bucket", "prefill_chunk", "rollout_slots")
    _check("RLConfig", self, names, lambda v: v >= 0, "must be >= 0")
    _check("RLConfig", self, ("temperature",), _finite_positive, "must be a finite number > 0")
    if self.temperature < MIN_TEMPERATURE:
      raise ValueError(
        f"RLConfig.temperature={self.temperature!r} is below the floor {MIN_TEMPERATURE}: "
        f"log-probs scale by 1 / temperature, and the IS ratio and k3 between the rollout "
        f"and the training path overflow to inf and NaN; use temperature >= "
        f"{MIN_TEMPERATURE} (the evaluation is greedy already)"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
  """How long and how fast the run trains."""

  steps: int = knob(150, "RL steps.")
  learning_rate: float = knob(8e-5, "Adam learning rate (small: each update's noise costs).")
  lr_warmup_steps: int = knob(0, "RL steps of linear LR warmup from learning_rate / 10.")
  lr_decay: str = knob(
    "cosine",
    "After the warmup: constant, or a cosine or linear fall to learning_rate / 10 at the last step.",
    choices=LR_DECAYS,
  )
  max_grad_norm: float = knob(1.0, "Clip each update's gradient to this global norm.")
  minibatches: int = knob(1, "Updates per epoch (1: pi_old is the update's own forward).")
  epochs: int = knob(1, "Passes over each rollout batch.")
  checkpoint_every: int = knob(20, "Checkpoint period in steps (and at the last step); 0: never.")
  max_param_abs: float = knob(1e4, "Divergence guard: stop, saving nothing, past this |param|.")
  max_staleness: int = knob(
    0,
    "Asynchronous RL: step j's rollouts come from policy version max(0, j - k), generated "
    "ahead in a thread, trained with the decoupled loss; 0: the synchronous loop.",
  )

  rollout_timeout: float = knob(
    3600.0,
    "Asynchronous RL or --rollout_devices: seconds the learner waits for a batch before "
    "it stops the run (a hung rollout side).",
  )

  def __post_init__(self):
    flags.check_choices(self, "RLConfig")  # lr_decay
    if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int):
      raise ValueError(f"RLConfig.max_staleness={self.max_staleness!r} must be an integer >= 0")
    names = ("steps", "lr_warmup_steps", "checkpoint_every", "max_staleness")
    _check("RLConfig", self, names, lambda v: v >= 0, "must be >= 0")
    _check("RLConfig", self, ("minibatches", "epochs"), lambda v: v >= 1, "must be >= 1")
    names = ("learning_rate", "max_grad_norm", "max_param_abs", "rollout_timeout")
    _check("RLConfig", self, names, _finite_positive, "must be a finite number > 0")
    if self.lr_decay != "constant" and 0 < self.steps <= self.lr_warmup_steps:
      raise ValueError(
        f"RLConfig.lr_decay={self.lr_decay!r} falls after the warmup, but steps={self.steps} "
        f"<= lr_warmup_steps={self.lr_warmup_steps} leaves no step to decay; use fewer "
        "--lr_warmup_steps, more --steps, or --lr_decay=constant"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
  """The greedy evaluation, in FP4 and in bf16, on held-out problems, and where the run's
  metrics are written beside metrics.jsonl."""

  eval_every: int = knob(20, "Greedy evaluation period (steps); 0: never.")
  eval_size: int = knob(
    512,
    "Evaluation problems, each once: a held-out split the task lists (chain: 324) whole "
    "when this covers it, else this many distinct; 0: no evaluation.",
  )
  version_diag_every: int = knob(
    0,
    "Asynchronous RL: every N steps split the mismatch into precision and version gaps "
    "(a training-path forward at the rollout's own weights); 0: never.",
  )
  tensorboard: bool = knob(
    True, "Also write metrics.jsonl's scalars and the config to <workdir>/tensorboard/."
  )
  wandb: bool = knob(
    False,
    "Also log metrics.jsonl's scalars and the config to Weights & Biases (the wandb extra: "
    "pip install 'trace_jax[wandb]'); a resume continues the same W&B run.",
  )
  wandb_project: str = knob("trace_jax", "The W&B project of --wandb.")

  def __post_init__(self):
    names = ("eval_every", "eval_size", "version_diag_every")
    _check("RLConfig", self, names, lambda v: v >= 0, "must be >= 0")
    names = ("tensorboard", "wandb")
    _check("RLConfig", self, names, lambda v: isinstance(v, bool), "must be a bool")
    _check(
      "RLConfig",
      self,
      ("wandb_project",),
      lambda v: isinstance(v, str) and v.strip() != "",
      "must be a project name",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
  """One RL run. Everything random derives from `seed` and the step number."""

  arm: str = knob("trace", _ARMS_HELP, section="arm")
  task: str = knob("chain_flawed", _TASKS_HELP, section="task")
  task_options: tuple = knob(
    (),
    "key=value options of the task (numbers parsed).",
    parse=flags.parse_pairs,
    section="task",
  )
  seed: int = knob(0, "Seed of everything random.")
  correction: str = knob(
    "auto",
    "Correction on pi_old / pi_rollout (auto: the arm's; TIS for fp4-rollout): tis, mask "
    "(tokens outside [1/C, C]), geo_mask (responses whose geometric-mean ratio leaves "
    "[1/C, C], C = --geo_threshold) or none.",
    flag="rollout_correction",
    choices=("auto",) + CORRECTIONS,
    section="arm",
  )
  reward_control: str = knob(
    "none",
    "shuffle: the matched placebo, each group's rewards permuted within the group before "
    "the advantages (the same groups carry advantages, which sample earned them is lost); "
    "shuffle_batch: permuted across the whole batch (nearly every group gets advantages: "
    "more noise than the real run). Compare either with the real run.",
    choices=REWARD_CONTROLS,
    section="loss",
  )
  sparse_delta: float = knob(
    fp4.DEFAULT_DELTA,
    "Arm trace-sparse: margin around an E2M1 midpoint (grid units) within which an "
    "element's bit is recorded.",
    section="arm",
  )
  compute_dtype: str = knob(
    "bfloat16", "Activations, both paths.", choices=COMPUTE_DTYPES, section="fp4"
  )
  rollout_skew: float = knob(
    0.0,
    "The arm's rollouts (not the evaluation) scale each layer's output by 1 + s * u, u in "
    "(-1, 1) hashed from (policy version, sequence, position, layer, element): an engine "
    "that computes differently from the trainer; 0: none.",
    section="sampling",
  )
  mesh: tuple = knob(
    (-1, 1, 1),
    "data,expert,model device counts; one may be -1: the devices the others leave (all of "
    "them by default; with --rollout_devices, those after the rollout group).",
    parse=flags.parse_ints,
    section="scale-out",
  )
  rollout_devices: int = knob(
    0,
    "The job's first N devices roll out (data-parallel replicas, FP4 weights whole on each), "
    "the learner's --mesh on the devices after them; 0: both share the mesh's devices.",
    section="scale-out",
  )
  source: Source = Source()
  sampling: Sampling = Sampling()
  loss: LossConfig = LossConfig(rollout_correction="none")  # set by `correction`
  schedule: Schedule = Schedule()
  decoupled: DecoupledConfig = DecoupledConfig()
  evaluation: Evaluation = Evaluation()
  fp4: QuantConfig = QuantConfig()  # the run's scheme; each path's derives from it

  def __post_init__(self):
    get_arm(self.arm, runnable=True)
    check_run_scheme(self.fp4, "RLConfig.fp4")
    object.__setattr__(self, "task_options", tuple(tuple(kv) for kv in self.task_options))
    object.__setattr__(self, "mesh", tuple(int(m) for m in self.mesh))
    if len(self.mesh) != 3 or any(m < 1 and m != -1 for m in self.mesh):
      raise ValueError(
        f"RLConfig.mesh={self.mesh} must be three device counts (data, expert, model), "
        "each >= 1 or -1 (the devices left), e.g. --mesh=-1,1,1"
      )
    if self.mesh.count(-1) > 1:
      raise ValueError(
        f"RLConfig.mesh={self.mesh} has {self.mesh.count(-1)} axes of -1; at most one axis "
        "takes the devices the others leave, e.g. --mesh=-1,2,1"
      )
    if not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63:
      raise ValueError(
        f"RLConfig.seed={self.seed!r} must be an integer that fits in int64 "
        f"([-2**63, 2**63 - 1]): every random key derives from it"
      )
    if self.task == "dataset:":
      raise ValueError("task='dataset:' names no file: --task=dataset:PATH (.jsonl or .parquet)")
    if not (self.task in registered() or self.task.startswith(("rg:", "dataset:"))):
      raise ValueError(f"task={self.task!r} is not registered; registered tasks: {registered()}")
    flags.check_choices(self, "RLConfig")  # correction, reward_control, compute_dtype
    check_amount(self.rollout_skew, "RLConfig.rollout_skew")
    slots, data = self.sampling.rollout_slots, self.mesh[0]
    if slots and data != -1 and slots % data:  # -1: the engine checks the resolved mesh
      raise ValueError(
        f"RLConfig.rollout_slots={slots} with mesh={list(self.mesh)}: the slots split over "
        f"the {data} data-parallel devices; allowed: a multiple of {data}, or 0 (the static "
        "batch)"
      )
    if self.rollout_skew and self.schedule.steps == 0:
      raise ValueError(
        f"RLConfig.rollout_skew={self.rollout_skew!r} skews the RL steps' rollouts, but "
        "steps=0 runs none (a warm start and evaluation only, never skewed); use "
        "--rollout_skew=0 or --steps >= 1"
      )
    if self.loss.rollout_correction != "none":
      raise ValueError(
        f"RLConfig.loss.rollout_correction={self.loss.rollout_correction!r}: the rollout "
        "correction has one knob, RLConfig.correction (auto, tis, mask or none); leave the "
        "LossConfig's at 'none'"
      )
    try:
      self.sparse_spec  # noqa: B018 - validates sparse_delta
    except ValueError as e:
      raise ValueError(f"RLConfig.sparse_delta={self.sparse_delta!r}: {e}") from e
    if self.arm_spec.guidance == "sparse" and self.fp4.fmt != "nvfp4":
      raise ValueError(
        f"RLConfig.fmt={self.fp4.fmt!r}: arm {self.arm!r} (sparse guidance) needs "
        "fmt='nvfp4' (E4M3 block scales)"
      )
    batch, minibatches, data = self.batch, self.schedule.minibatches, self.mesh[0]
    if batch % minibatches:
      raise ValueError(
        f"RLConfig: batch {batch} (prompts_per_step x group_size) does not split into "
        f"{minibatches} minibatches"
      )
    if data != -1 and (batch % data or (batch // minibatches) % data):  # -1: `on_devices`
      raise ValueError(
        f"RLConfig: batch {batch} and its minibatches must divide over {data} data-parallel "
        f"devices; allowed: prompts_per_step x group_size a multiple of {data * minibatches} "
        f"({minibatches} minibatch(es) of a multiple of {data}), or a --mesh data axis that "
        f"divides {batch // minibatches}"
      )
    rollout = self.rollout_devices
    if isinstance(rollout, bool) or not isinstance(rollout, int) or rollout < 0:
      raise ValueError(
        f"RLConfig.rollout_devices={rollout!r} must be an integer >= 0 (0: rollouts share "
        "the learner's devices)"
      )
    if rollout and batch % rollout:
      raise ValueError(
        f"RLConfig.rollout_devices={rollout}: the rollout replicas split the batch {batch} "
        f"(prompts_per_step x group_size), which {rollout} does not divide; use a divisor of "
        f"{batch}, or 0"
      )

  def on_devices(self, devices: int, recorded: tuple | None = None) -> "RLConfig":
    """This config with RLConfig.mesh's -1 axis (MaxText's convention) the devices the other
    axes leave of `devices` (less the rollout group's `rollout_devices`); `recorded`, the
    mesh a resumed run recorded, is kept where the spec allows it and the devices hold it.

    Raises:
      ValueError: naming mesh (and rollout_devices) when the devices left do not divide by
        the other axes, or the batch does not divide over the resolved data axis.
    """
    if -1 not in self.mesh:
      return self
    rollout, fixed = self.rollout_devices, math.prod(m for m in self.mesh if m != -1)
    left = devices - rollout
    if recorded is not None and mesh_matches(self.mesh, recorded) and math.prod(recorded) <= left:
      mesh = tuple(recorded)
    elif left >= fixed and left % fixed == 0:
      mesh = resolve_mesh(self.mesh, left)
    elif rollout:
      raise ValueError(
        f"RLConfig.rollout_devices={rollout} leaves the learner {max(0, left)} of this job's "
        f"{devices} devices, and its RLConfig.mesh={self.mesh} needs a positive multiple of "
        f"{fixed} (its -1 axis takes the devices left); allowed: rollout_devices leaving a "
        f"multiple of {fixed}, or 0 (rollouts share the learner's devices)"
      )
    else:
      raise ValueError(
        f"RLConfig.mesh={self.mesh}: its -1 axis takes the devices the other axes leave, "
        f"but this job's {devices} devices do not divide by their {fixed}; give every axis "
        "a size, or axes whose product divides the device count"
      )
    where = f"the {left} devices after rollout_devices={rollout}" if rollout else None
    where = where or f"this job's {devices} devices"
    try:
      return dataclasses.replace(self, mesh=mesh)
    except ValueError as e:
      raise ValueError(f"RLConfig.mesh={self.mesh} is {mesh} on {where}: {e}") from e

  @property
  def batch(self) -> int:
    return self.sampling.prompts_per_step * self.sampling.group_size

  @property
  def arm_spec(self) -> Arm:
    return get_arm(self.arm)

  @property
  def train_quant(self) -> QuantConfig | None:
    """The arm's training-path QuantConfig in this run's FP4 scheme."""
    return self.arm_spec.train_scheme(self.fp4)

  @property
  def sparse_spec(self) -> fp4.SparseSpec:
    """What a sparse capture flags (arm trace-sparse)."""
    return fp4.SparseSpec(delta=self.sparse_delta)

  @property
  def loss_config(self) -> LossConfig:
    correction = self.arm_spec.correction if self.correction == "auto" else self.correction
    return dataclasses.replace(self.loss, rollout_correction=correction)

  @classmethod
  def from_flat(cls, **values) -> "RLConfig":
    """An RLConfig from flat field names (`utils.flags`): RLConfig.from_flat(steps=3)."""
    return flags.from_flat(cls, values)

  def replace(self, **values) -> "RLConfig":
    """This config with fields changed, by flat name."""
    return flags.from_flat(RLConfig, values, base=self)

  def to_dict(self) -> dict:
    """JSON-ready and nested like the config (lists for tuples)."""
    return _jsonish(dataclasses.asdict(self))

  @classmethod
  def from_dict(cls, saved: dict) -> "RLConfig":
    """The config a `to_dict` (or a flat config saved before the sections) was made of."""
    leaves = flags.flat_fields(cls)
    values = {k: v for k, v in cls.flat_dict(saved).items() if k in leaves}
    for name in ("task_options", "chat_template_options", "mesh"):
      if name in values:
        values[name] = tuple(tuple(v) if isinstance(v, list) else v for v in values[name])
    return cls.from_flat(**values)

  @staticmethod
  def flat_dict(saved: dict, devices: int | None = None) -> dict:
    """A saved config (JSON, nested or flat) by flat name; its LossConfig's correction is
    "none" (saved before `correction` was the one knob, it may say "tis"). With `devices`,
    a mesh's -1 axis is the size it takes on that many (`on_devices`; kept where they do
    not divide), so a study's cell compares by the mesh it runs on here."""
    out = _jsonish(flags.flatten(RLConfig, saved))
    out = {**BEFORE_ADDED, **out}
    if "rollout_correction" in out:
      out["rollout_correction"] = "none"
    mesh = out["mesh"]
    if devices is not None and isinstance(mesh, list) and -1 in mesh:
      left = devices - int(out.get("rollout_devices") or 0)
      fixed = math.prod(m for m in mesh if m != -1)
      if left >= fixed > 0 and left % fixed == 0:
        out["mesh"] = list(resolve_mesh(tuple(mesh), left))
    return out

  def differences(
    self,
    other: dict,
    ignore=("steps",) + RESUMABLE_FIELDS,
  ) -> list[str]:
    """Flat names of the fields whose values differ from a saved config dict (nested or
    flat); a field the saved config lacks counts as its default there."""
    mine = self.flat_dict(self.to_dict())
    theirs = {**self.flat_dict(RLConfig().to_dict()), **self.flat_dict(other)}
    if "mesh" not in ignore and _meshes_match(mine["mesh"], theirs["mesh"]):
      ignore = (*ignore, "mesh")  # a -1 axis (the devices left) matches any size
    return sorted(
      k for k in set(mine) | set(theirs) if k not in ignore and mine.get(k) != theirs.get(k)
    )


def resolve_mesh(mesh: tuple, devices: int) -> tuple:
  """`mesh` with its -1 axis (if any) the `devices` the other axes leave: devices divided
  by their product, which must divide it (`RLConfig.on_devices` says so by name)."""
  fixed = math.prod(m for m in mesh if m != -1)
  return tuple(devices // fixed if m == -1 else m for m in mesh)


def mesh_matches(spec, mesh) -> bool:
  """Whether the concrete `mesh` is one `spec` allows: equal on every axis but a -1 one."""
  return len(spec) == len(mesh) and all(s in (-1, m) for s, m in zip(spec, mesh))


def _meshes_match(a, b) -> bool:
  """Two saved meshes that may be the same run's: equal but where either says -1."""
  return isinstance(a, list) and isinstance(b, list) and (mesh_matches(a, b) or mesh_matches(b, a))


def _jsonish(value):
  """Tuples as lists, so a config compares equal to its JSON round trip."""
  if isinstance(value, dict):
    return {k: _jsonish(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonish(v) for v in value]
  return value
