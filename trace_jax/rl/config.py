"""The RL arms (DESIGN.md section 4) and the run configuration."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trace_jax.model.config import PRESETS
from trace_jax import fp4
from trace_jax.model.quant import SITE_SCOPES, QuantConfig
from trace_jax.rl.grpo import LossConfig
from trace_jax.tasks.registry import get_task, registered


@dataclasses.dataclass(frozen=True)
class Arm:
  """How one arm rolls out and trains.

  Attributes:
    name: the arm's name.
    rollout_precision: "bf16" or "fp4" (W4A4 + FP4 KV cache).
    guidance: what the rollout captures for the trainer: "none", "compact" or "full".
    guided_layers: which layers.
    train_quant: the training path's QuantConfig (None: bf16, no quantization).
    routing_replay: train with the rollout's experts.
    correction: the default rollout correction ("tis", "mask", "none").
    deploy: precision the arm's policy is deployed (and headline-evaluated) in.
  """

  name: str
  rollout_precision: str
  guidance: str
  guided_layers: Any
  train_quant: QuantConfig | None
  routing_replay: bool
  correction: str
  deploy: str


ARMS = {
    "bf16": Arm("bf16", "bf16", "none", "none", None, False, "none", "bf16"),
    "fp4-rollout": Arm("fp4-rollout", "fp4", "none", "none", None, False, "tis", "fp4"),
    "fp4-qat": Arm("fp4-qat", "fp4", "none", "none", QuantConfig(), False, "none", "fp4"),
    "trace": Arm("trace", "fp4", "compact", "last_half",
                 QuantConfig(rounding="guided", guided_layers="last_half"), True, "none", "fp4"),
    "trace-full": Arm("trace-full", "fp4", "full", "all",
                      QuantConfig(rounding="guided", guided_layers="all"), True, "none", "fp4"),
    # PTQ: trained exactly like bf16; its headline is the FP4 evaluation of that policy.
    "ptq": Arm("ptq", "bf16", "none", "none", None, False, "none", "fp4"),
}


def get_arm(name: str) -> Arm:
  if name not in ARMS:
    raise ValueError(f"arm={name!r} is not known; arms: {sorted(ARMS)}")
  return ARMS[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
  """One RL run. Everything random derives from `seed` and the step number."""

  arm: str = "trace"
  fp4_sites: str = "all"  # FP4 scope of rollout and QAT: "all" or "experts+kv" (the method's)
  fmt: str = "nvfp4"  # FP4 format of rollout, QAT and the FP4 evaluation: "nvfp4" or "mxfp4"
  task: str = "arith"
  task_options: tuple = ()  # (name, value) pairs passed to get_task
  preset: str = "small"
  seed: int = 0
  steps: int = 120
  prompts_per_step: int = 8  # distinct problems per step
  group_size: int = 16  # samples per problem (GRPO group)
  max_new_tokens: int = 32  # per turn
  temperature: float = 0.7  # sampling (and the tempered policy the loss trains)
  learning_rate: float = 1e-4
  minibatches: int = 2  # optimizer updates per epoch
  epochs: int = 1
  loss: LossConfig = LossConfig(rollout_correction="none")
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
  remat: bool = False  # recompute each block's activations in the backward pass (memory)

  def __post_init__(self):
    get_arm(self.arm)
    if self.fp4_sites not in SITE_SCOPES:
      raise ValueError(f"RLConfig.fp4_sites={self.fp4_sites!r} is not allowed; use one of "
                       f"{SITE_SCOPES}")
    if self.fmt not in fp4.FORMATS:
      raise ValueError(f"RLConfig.fmt={self.fmt!r} is not allowed; use one of {sorted(fp4.FORMATS)}")
    if self.preset not in PRESETS:
      raise ValueError(f"preset={self.preset!r} is not known; presets: {sorted(PRESETS)}")
    if not (self.task in registered() or self.task.startswith("rg:")):
      raise ValueError(f"task={self.task!r} is not registered; registered tasks: {registered()}")
    object.__setattr__(self, "task_options", tuple(tuple(kv) for kv in self.task_options))
    get_task(self.task, **dict(self.task_options))  # option names and values, before any work
    object.__setattr__(self, "mesh", tuple(int(m) for m in self.mesh))
    for name in ("steps", "eval_every", "eval_size", "checkpoint_every", "sft_steps",
                 "prompt_bucket"):
      if getattr(self, name) < 0:
        raise ValueError(f"RLConfig.{name}={getattr(self, name)} must be >= 0")
    for name in ("prompts_per_step", "group_size", "max_new_tokens", "minibatches", "epochs",
                 "sft_batch"):
      if getattr(self, name) < 1:
        raise ValueError(f"RLConfig.{name}={getattr(self, name)} must be >= 1")
    for name in ("temperature", "learning_rate", "sft_learning_rate", "max_param_abs"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"RLConfig.{name}={value!r} must be a finite number > 0")
    if self.correction not in ("auto", "tis", "mask", "none"):
      raise ValueError(f"RLConfig.correction={self.correction!r}; use auto, tis, mask or none")
    if self.batch % self.minibatches:
      raise ValueError(f"RLConfig: batch {self.batch} (prompts_per_step x group_size) does not "
                       f"split into {self.minibatches} minibatches")
    if len(self.mesh) != 3 or min(self.mesh) < 1:
      raise ValueError(f"RLConfig.mesh={self.mesh} must be (data, expert, model) sizes >= 1")
    if self.batch % self.mesh[0] or (self.batch // self.minibatches) % self.mesh[0]:
      raise ValueError(f"RLConfig: batch {self.batch} and its minibatches must divide over "
                       f"{self.mesh[0]} data-parallel devices")
    if self.compute_dtype not in ("bfloat16", "float32"):
      raise ValueError(f"RLConfig.compute_dtype={self.compute_dtype!r}; use bfloat16 or float32")

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
    return None if quant is None else quant.replace(sites=self.fp4_sites, fmt=self.fmt)

  @property
  def loss_config(self) -> LossConfig:
    correction = self.arm_spec.correction if self.correction == "auto" else self.correction
    return dataclasses.replace(self.loss, rollout_correction=correction)

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["task_options"] = [list(kv) for kv in self.task_options]
    out["mesh"] = list(self.mesh)
    return out

  def differences(self, other: dict, ignore=("steps", "max_param_abs", "remat")) -> list[str]:
    """Fields whose values differ from a saved config dict (JSON round-tripped)."""
    mine = _jsonish(self.to_dict())
    theirs = _jsonish(other)
    return sorted(k for k in set(mine) | set(theirs)
                  if k not in ignore and mine.get(k) != theirs.get(k))


def _jsonish(value):
  """Normalise tuples to lists so a config compares equal to its JSON round trip."""
  if isinstance(value, dict):
    return {k: _jsonish(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonish(v) for v in value]
  return value
