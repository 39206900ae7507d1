"""rl/config.py: the arm table (keyword-only, validated, guided layers stated once), the one
rollout-correction knob, and experiments/rl.py's flag defaults read from the config classes."""

import dataclasses
import importlib.util
import os

import pytest
from absl import flags

from trace_jax.model.quant import QuantConfig
from trace_jax.rl.config import ARMS, Arm, RLConfig
from trace_jax.rl.grpo import LossConfig

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arm_table_states_the_method_once():
  # DESIGN.md section 4, written down independently of the table.
  expected = {  # name: (rollout, training QuantConfig, guidance, replay, correction, deploy)
    "bf16": ("bf16", None, "none", False, "none", "bf16"),
    "fp4-rollout": ("fp4", None, "none", False, "tis", "fp4"),
    "fp4-qat": ("fp4", QuantConfig(), "none", False, "none", "fp4"),
    "trace": (
      "fp4",
      QuantConfig(rounding="guided", guided_layers="last_half"),
      "compact",
      True,
      "none",
      "fp4",
    ),
    "trace-full": (
      "fp4",
      QuantConfig(rounding="guided", guided_layers="all"),
      "full",
      True,
      "none",
      "fp4",
    ),
    "trace-sparse": (
      "fp4",
      QuantConfig(rounding="guided", guided_layers="all"),
      "sparse",
      True,
      "none",
      "fp4",
    ),
    "ptq": ("bf16", None, "none", False, "none", "fp4"),
  }
  assert sorted(ARMS) == sorted(expected)
  for name, (rollout, quant, guidance, replay, correction, deploy) in expected.items():
    arm = ARMS[name]
    assert (
      arm.rollout_precision,
      arm.train_quant,
      arm.guidance,
      arm.routing_replay,
      arm.correction,
      arm.deploy,
    ) == (rollout, quant, guidance, replay, correction, deploy)
    if quant is not None and quant.rounding == "guided":  # guided layers: one statement
      assert arm.train_quant.guided_layers == arm.guided_layers


def test_arm_is_keyword_only_and_validated():
  with pytest.raises(TypeError):
    Arm("x", "fp4", "qat")  # pylint: disable=too-many-function-args
  cases = [
    (dict(rollout_precision="fp8", train="qat"), "rollout_precision='fp8'"),
    (dict(rollout_precision="fp4", train="guided"), "train='guided' needs guidance"),
    (
      dict(rollout_precision="fp4", train="guided", guidance="compact", guided_layers="none"),
      "train='guided' needs guidance",
    ),
    (
      dict(rollout_precision="fp4", train="qat", guidance="full", guided_layers="all"),
      "only read by train='guided'",
    ),
    (
      dict(rollout_precision="bf16", train="guided", guidance="full", guided_layers="all"),
      "needs rollout_precision='fp4'",
    ),
    (
      dict(rollout_precision="fp4", train="guided", guidance="full", guided_layers="deep"),
      "guided_layers='deep'",
    ),
    (dict(rollout_precision="fp4", train="qat", correction="clip"), "correction='clip'"),
  ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message):
      Arm(name="x", **kwargs)


def test_one_rollout_correction_knob():
  assert RLConfig(arm="fp4-rollout").loss_config.rollout_correction == "tis"
  assert RLConfig(arm="trace", correction="mask").loss_config.rollout_correction == "mask"
  with pytest.raises(ValueError, match="one knob, RLConfig.correction"):
    RLConfig(loss=LossConfig(rollout_correction="tis"))
  # A config saved before the knob was one (its LossConfig said "tis") still resumes.
  saved = RLConfig().to_dict()
  saved["loss"] = {**saved["loss"], "rollout_correction": "tis"}
  assert RLConfig().differences(saved) == []


def test_rl_script_flag_defaults_are_the_config_defaults():
  spec = importlib.util.spec_from_file_location(
    "rl_script", os.path.join(_ROOT, "experiments", "rl.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # defines the flags (absl's global FLAGS)
  del module
  config, loss = RLConfig(), RLConfig().loss
  defaults = {
    name: flags.FLAGS[name].default
    for name in flags.FLAGS
    if name
    in {
      "arm",
      "task",
      "preset",
      "steps",
      "seed",
      "prompts_per_step",
      "group_size",
      "max_new_tokens",
      "temperature",
      "learning_rate",
      "minibatches",
      "epochs",
      "eval_every",
      "eval_size",
      "sft_steps",
      "checkpoint_every",
      "compute_dtype",
      "fp4_sites",
      "fmt",
      "clip_low",
      "clip_high",
      "aggregation",
      "std_norm",
      "kl_coef",
      "tis_threshold",
      "rollout_correction",
      "mesh",
      "sparse_delta",
      "reward_control",
    }
  }
  assert len(defaults) == 29
  for name, value in defaults.items():
    if name == "rollout_correction":  # the flag is the one knob, RLConfig.correction
      assert value == config.correction
    elif name in {f.name for f in dataclasses.fields(LossConfig)}:
      assert value == getattr(loss, name), name
    elif name == "mesh":
      assert tuple(int(m) for m in value) == config.mesh
    else:
      assert value == getattr(config, name), name
