"""The configuration of an RL run."""

from __future__ import annotations

import dataclasses
import math

from trace_jax.model.config import PRESETS, get_preset
from trace_jax import fp4
from trace_jax.model.quant import ACTIVATION_FORMATS, SITE_SCOPES, QuantConfig
from trace_jax.rl.arms import Arm, get_arm
from trace_jax.rl.grpo import CORRECTIONS, LossConfig
from trace_jax.run.policy_source import check_checkpoint_files
from trace_jax.tasks.registry import get_task, registered


REWARD_CONTROLS = ("none", "shuffle")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
  """One RL run. Everything random derives from `seed` and the step number."""

  arm: str = "trace"
  fp4_sites: str = "all"  # FP4 scope of rollout and QAT: "all" or "experts+kv" (the method's)
  fmt: str = "nvfp4"  # FP4 format of rollout, QAT and the FP4 evaluation: "nvfp4" or "mxfp4"
  activations: str = "fp4"  # "fp4" (W4A4) or "fp8" (W4A8: linear inputs in MXFP8 E4M3 on
  #   both paths, KV cache in FP4; FP8 sites take nearest rounding, no guidance)
  sparse_delta: float = fp4.DEFAULT_DELTA  # sparse guidance (arm trace-sparse): element
  #   margin around an E2M1 midpoint in grid units (calibrated: fp4.sparse.DEFAULT_DELTA)
  task: str = "chain"
  task_options: tuple = ()  # (name, value) pairs passed to get_task
  preset: str = "small"
  seed: int = 0
  steps: int = 100
  prompts_per_step: int = 8  # distinct problems per step
  group_size: int = 16  # samples per problem (GRPO group)
  max_new_tokens: int = 32  # per turn
  temperature: float = 0.7  # sampling (and the tempered policy the loss trains)
  learning_rate: float = 3e-5  # small: each update's noise costs the warm start (README)
  lr_warmup_steps: int = 0  # RL steps of linear warmup from learning_rate / 10
  minibatches: int = 1  # optimizer updates per epoch (1: pi_old is the update's own forward)
  epochs: int = 1
  loss: LossConfig = LossConfig(rollout_correction="none")  # its rollout_correction is set
  #   by `correction` (the one knob); leave it "none"
  correction: str = "auto"  # rollout correction: "auto" = the arm's default, or tis/mask/none
  compute_dtype: str = "bfloat16"  # activations on both paths
  prompt_bucket: int = 0  # pad prompts / observations to a multiple; 0 = 16 (8 multi-turn)
  eval_every: int = 20
  eval_size: int = 128
  checkpoint_every: int = 20
  sft_steps: int = 100  # warm start, when the workdir has none
  sft_batch: int = 32
  sft_learning_rate: float = 3e-3
  mesh: tuple = (1, 1, 1)  # (data, expert, model) devices
  max_param_abs: float = 1e4  # divergence guard: stop (saving nothing) past this |parameter|
  # Starting from a local Hugging Face checkpoint (`rl.policy_source`); "" = the preset.
  hf_checkpoint: str = ""  # directory: config.json, *.safetensors, tokenizer.json, ...
  sft_warm_start: bool | None = None  # None: for a preset yes, for a checkpoint no
  prompt_format: str = "auto"  # "chat" (the checkpoint's template), "raw"; auto: chat if hf
  system_prompt: str = ""  # the chat template's system turn ("" = none)
  observation_role: str = "user"  # multi-turn observations as "user" or "tool" turns
  chat_template_options: tuple = ()  # (name, value) template variables, e.g. enable_thinking
  remat: bool = False  # recompute each block's activations in the backward pass (memory)
  reward_control: str = "none"  # "shuffle": a placebo run; each step's rewards are permuted
  #   across the batch before the advantages (the logged rewards are the true ones), so the
  #   update carries the optimizer's noise and no signal: the real run minus this one is
  #   what the reward taught

  def __post_init__(self):
    get_arm(self.arm, runnable=True)
    if self.fp4_sites not in SITE_SCOPES:
      raise ValueError(
        f"RLConfig.fp4_sites={self.fp4_sites!r} is not allowed; use one of {SITE_SCOPES}"
      )
    if self.fmt not in fp4.FORMATS:
      raise ValueError(
        f"RLConfig.fmt={self.fmt!r} is not allowed; use one of {sorted(fp4.FORMATS)}"
      )
    if self.preset not in PRESETS:
      raise ValueError(f"preset={self.preset!r} is not known; presets: {sorted(PRESETS)}")
    if self.activations not in ACTIVATION_FORMATS:
      raise ValueError(
        f"RLConfig.activations={self.activations!r} is not allowed; use one of {ACTIVATION_FORMATS}"
      )
    _check_block_fit(self.preset, self.fmt, self.fp4_sites)
    try:
      self.sparse_spec  # noqa: B018 - validates sparse_delta
    except ValueError as e:
      raise ValueError(f"RLConfig.sparse_delta={self.sparse_delta!r}: {e}") from e
    if self.arm_spec.guidance == "sparse" and self.fmt != "nvfp4":
      raise ValueError(
        f"RLConfig.fmt={self.fmt!r}: arm {self.arm!r} (sparse guidance) needs "
        "fmt='nvfp4' (E4M3 block scales)"
      )
    if not (self.task in registered() or self.task.startswith("rg:")):
      raise ValueError(f"task={self.task!r} is not registered; registered tasks: {registered()}")
    object.__setattr__(self, "task_options", tuple(tuple(kv) for kv in self.task_options))
    get_task(self.task, **dict(self.task_options))  # option names and values, before any work
    object.__setattr__(self, "mesh", tuple(int(m) for m in self.mesh))
    for name in (
      "steps",
      "eval_every",
      "eval_size",
      "checkpoint_every",
      "sft_steps",
      "prompt_bucket",
      "lr_warmup_steps",
    ):
      if getattr(self, name) < 0:
        raise ValueError(f"RLConfig.{name}={getattr(self, name)} must be >= 0")
    for name in (
      "prompts_per_step",
      "group_size",
      "max_new_tokens",
      "minibatches",
      "epochs",
      "sft_batch",
    ):
      if getattr(self, name) < 1:
        raise ValueError(f"RLConfig.{name}={getattr(self, name)} must be >= 1")
    for name in ("temperature", "learning_rate", "sft_learning_rate", "max_param_abs"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"RLConfig.{name}={value!r} must be a finite number > 0")
    if self.reward_control not in REWARD_CONTROLS:
      raise ValueError(
        f"RLConfig.reward_control={self.reward_control!r} is not allowed; use one "
        f"of {REWARD_CONTROLS}"
      )
    if self.correction not in ("auto",) + CORRECTIONS:
      raise ValueError(f"RLConfig.correction={self.correction!r}; use auto, tis, mask or none")
    if self.loss.rollout_correction != "none":
      raise ValueError(
        f"RLConfig.loss.rollout_correction={self.loss.rollout_correction!r}: "
        f"the rollout correction has one knob, RLConfig.correction (auto, tis, "
        f"mask or none); leave the LossConfig's at 'none'"
      )
    if self.batch % self.minibatches:
      raise ValueError(
        f"RLConfig: batch {self.batch} (prompts_per_step x group_size) does not "
        f"split into {self.minibatches} minibatches"
      )
    if len(self.mesh) != 3 or min(self.mesh) < 1:
      raise ValueError(f"RLConfig.mesh={self.mesh} must be (data, expert, model) sizes >= 1")
    if self.batch % self.mesh[0] or (self.batch // self.minibatches) % self.mesh[0]:
      raise ValueError(
        f"RLConfig: batch {self.batch} and its minibatches must divide over "
        f"{self.mesh[0]} data-parallel devices"
      )
    if self.compute_dtype not in ("bfloat16", "float32"):
      raise ValueError(f"RLConfig.compute_dtype={self.compute_dtype!r}; use bfloat16 or float32")
    self._check_checkpoint_fields()

  def _check_checkpoint_fields(self):
    """hf_checkpoint and the prompt options (the files' contents are checked by the Trainer
    through `policy_source.check`, still before any work)."""
    if self.hf_checkpoint:
      object.__setattr__(self, "hf_checkpoint", check_checkpoint_files(self.hf_checkpoint))
    if self.prompt_format not in ("auto", "chat", "raw"):
      raise ValueError(f"RLConfig.prompt_format={self.prompt_format!r}; use auto, chat or raw")
    if self.observation_role not in ("user", "tool"):
      raise ValueError(f"RLConfig.observation_role={self.observation_role!r}; use user or tool")
    if self.sft_warm_start not in (None, True, False):
      raise ValueError(f"RLConfig.sft_warm_start={self.sft_warm_start!r}; use None, True or False")
    chat = self.prompt_format == "chat" or (self.prompt_format == "auto" and self.hf_checkpoint)
    if not self.hf_checkpoint and self.prompt_format == "chat":
      raise ValueError(
        "RLConfig.prompt_format='chat' needs hf_checkpoint (the built-in "
        "character tokenizer has no chat template)"
      )
    if self.system_prompt and not chat:
      raise ValueError(
        f"RLConfig.system_prompt={self.system_prompt!r} needs a chat template "
        "(hf_checkpoint with prompt_format auto or chat)"
      )
    object.__setattr__(
      self, "chat_template_options", tuple(tuple(kv) for kv in self.chat_template_options)
    )
    if any(len(kv) != 2 or not isinstance(kv[0], str) for kv in self.chat_template_options):
      raise ValueError(
        f"RLConfig.chat_template_options={self.chat_template_options!r} must be (name, value) pairs"
      )

  @property
  def batch(self) -> int:
    return self.prompts_per_step * self.group_size

  @property
  def arm_spec(self) -> Arm:
    return get_arm(self.arm)

  @property
  def train_quant(self) -> QuantConfig | None:
    """The arm's training-path QuantConfig in this run's FP4 scope and format."""
    quant = self.arm_spec.train_quant
    return (
      None
      if quant is None
      else quant.replace(sites=self.fp4_sites, fmt=self.fmt, activations=self.activations)
    )

  @property
  def sparse_spec(self) -> fp4.SparseSpec:
    """What a sparse capture flags (arm trace-sparse)."""
    return fp4.SparseSpec(delta=self.sparse_delta)

  @property
  def loss_config(self) -> LossConfig:
    correction = self.arm_spec.correction if self.correction == "auto" else self.correction
    return dataclasses.replace(self.loss, rollout_correction=correction)

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["task_options"] = [list(kv) for kv in self.task_options]
    out["mesh"] = list(self.mesh)
    out["chat_template_options"] = [list(kv) for kv in self.chat_template_options]
    return out

  def differences(self, other: dict, ignore=("steps", "max_param_abs", "remat")) -> list[str]:
    """Fields whose values differ from a saved config dict (JSON round-tripped)."""
    mine = _jsonish(self.to_dict())
    # A field added after the checkpoint was saved counts as its default there.
    defaults = {
      f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING
    }
    theirs = _jsonish({**{k: v for k, v in defaults.items() if k not in other}, **other})
    if isinstance(theirs.get("loss"), dict):  # saved before `correction` was the one knob
      theirs["loss"] = {**theirs["loss"], "rollout_correction": "none"}
    return sorted(
      k for k in set(mine) | set(theirs) if k not in ignore and mine.get(k) != theirs.get(k)
    )


def _check_block_fit(preset: str, fmt: str, sites: str) -> None:
  """A ValueError before any work if the preset's widths do not split into `fmt`'s blocks
  (MXFP4's 32-element blocks on the tiny presets' 16-wide heads), naming the field and the
  presets that fit."""
  block = fp4.get_format(fmt).block_size
  misfits = {f: w for f, w in get_preset(preset).quantized_widths(sites).items() if w % block}
  if not misfits:
    return
  fits = [
    name
    for name in PRESETS
    if not any(w % block for w in get_preset(name).quantized_widths(sites).values())
  ]
  fields = ", ".join(f"{f}={w}" for f, w in misfits.items())
  raise ValueError(
    f"RLConfig.fmt={fmt!r} quantizes in blocks of {block}, but preset={preset!r} "
    f"has {fields} (not a multiple of {block}); use a preset that fits, one of "
    f"{fits}, or fmt='nvfp4'"
  )


def _jsonish(value):
  """Normalise tuples to lists so a config compares equal to its JSON round trip."""
  if isinstance(value, dict):
    return {k: _jsonish(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonish(v) for v in value]
  return value
