"""rl/arms.py and rl/config.py: the arm table (keyword-only, validated, guided layers stated once), the one
rollout-correction knob, and experiments/rl.py's flag defaults read from the config classes."""

import dataclasses
import importlib.util
import os

import pytest
from absl import flags

from trace_jax.model.quant import QuantConfig
from trace_jax.rl.arms import ARMS, COMPARED, RUNNABLE, Arm
from trace_jax.rl.config import RLConfig
from trace_jax.rollout.config import RolloutConfig
from trace_jax.rl.grpo import LossConfig

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arm_table_states_the_method_once():
  # DESIGN.md section 4, written down independently of the table.
  guided = lambda layers: QuantConfig(rounding="guided", guided_layers=layers)  # noqa: E731
  expected = {  # name: (rollout, training QuantConfig, guidance, replay, correction, deploy,
    #                    derived from, block-scale rule)
    "bf16": ("bf16", None, "none", False, "none", "bf16", None, "standard"),
    "fp4-rollout": ("fp4", None, "none", False, "tis", "fp4", None, "standard"),
    "fp4-qat": ("fp4", QuantConfig(), "none", False, "none", "fp4", None, "standard"),
    "trace": ("fp4", guided("last_half"), "compact", True, "none", "fp4", None, "standard"),
    "trace-full": ("fp4", guided("all"), "full", True, "none", "fp4", None, "standard"),
    "trace-sparse": ("fp4", guided("all"), "sparse", True, "none", "fp4", None, "standard"),
    "ptq": ("bf16", None, "none", False, "none", "fp4", "bf16", "standard"),
    "ptq-46": ("bf16", None, "none", False, "none", "fp4", "bf16", "4over6"),
  }
  assert sorted(ARMS) == sorted(expected)
  for name, row in expected.items():
    arm = ARMS[name]
    assert (
      arm.rollout_precision,
      arm.train_quant,
      arm.guidance,
      arm.routing_replay,
      arm.correction,
      arm.deploy,
      arm.derived_from,
      arm.scale_rule,
    ) == row, name
    if arm.train_quant is not None and arm.train_quant.rounding == "guided":  # stated once
      assert arm.train_quant.guided_layers == arm.guided_layers
  # An RL run reports every arm but ptq-46 (4over6 is evaluated by the comparison); the
  # comparison runs the method's arms, trace-sparse (beyond the method) on request.
  assert set(RUNNABLE) == set(expected) - {"ptq-46"}
  assert COMPARED == ("bf16", "fp4-rollout", "fp4-qat", "trace", "trace-full", "ptq", "ptq-46")
  with pytest.raises(ValueError, match="arm='ptq-46' packs the bf16 run's policy"):
    RLConfig(arm="ptq-46")


def test_each_arm_states_its_rollout():
  """The rollout an arm runs (precision, capture, guided layers, routing), by hand: FP4
  arms that train in FP4 capture at least compact guidance on every layer (the per-layer
  disagreement is measured each step), others capture what they train on."""
  base = RolloutConfig(max_len=64)
  expected = {  # name: (precision, guidance captured, its layers, routing recorded)
    "bf16": ("bf16", "none", "none", False),
    "fp4-rollout": ("fp4", "none", "none", False),
    "fp4-qat": ("fp4", "compact", "all", False),
    "trace": ("fp4", "compact", "all", True),
    "trace-full": ("fp4", "full", "all", True),
    "trace-sparse": ("fp4", "sparse", "all", True),
    "ptq": ("bf16", "none", "none", False),
    "ptq-46": ("bf16", "none", "none", False),
  }
  for name, row in expected.items():
    r = ARMS[name].rollout(base)
    assert (r.precision, r.guidance, r.guided_layers, r.record_routing) == row, name
    assert r.max_len == 64  # the rest is the base's


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
