"""rl/arms.py and rl/config.py: the arm table (keyword-only, validated, guided layers stated once), the one
rollout-correction knob, and experiments/rl.py's flag defaults read from the config classes."""

import dataclasses

import numpy as np

import pytest
from absl import flags

from tests.scripts import load_script
from trace_jax import fp4
from trace_jax.model import quant as quant_lib
from trace_jax.model.quant import QuantConfig
from trace_jax.rl.arms import ARMS, COMPARED, RUNNABLE, Arm
from trace_jax.rl.config import RLConfig
from trace_jax.rollout.config import RolloutConfig
from trace_jax.utils import flags as config_flags
from trace_jax.rl.grpo import LossConfig


def test_arm_table_states_the_method_once():
  # DESIGN.md section 4, written down independently of the table.
  guided = lambda layers: QuantConfig(rounding="guided", guided_layers=layers)  # noqa: E731
  expected = {  # name: (rollout, training QuantConfig, guidance, replay, correction, deploy,
    #                    derived from, block-scale rule)
    "bf16": ("bf16", None, "none", False, "none", "bf16", None, "standard"),
    "fp4-rollout": ("fp4", None, "none", False, "tis", "fp4", None, "standard"),
    "fp4-qat": ("fp4", QuantConfig(), "none", False, "none", "fp4", None, "standard"),
    "fp4-qat-r3": ("fp4", QuantConfig(), "none", True, "none", "fp4", None, "standard"),
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
      arm.train_scheme(QuantConfig()),
      arm.guidance,
      arm.routing_replay,
      arm.correction,
      arm.deploy,
      arm.derived_from,
      arm.scale_rule,
    ) == row, name
    train = arm.train_scheme(QuantConfig())
    if train is not None and train.rounding == "guided":  # stated once
      assert train.guided_layers == arm.guided_layers
  # An RL run reports every arm but ptq-46 (4over6 is evaluated by the comparison); the
  # comparison runs the method's arms, trace-sparse (beyond the method) on request.
  assert set(RUNNABLE) == set(expected) - {"ptq-46"}
  assert COMPARED == ("bf16", "fp4-rollout", "fp4-qat", "trace", "trace-full", "ptq", "ptq-46")
  with pytest.raises(ValueError, match="arm='ptq-46' packs the bf16 run's policy"):
    RLConfig.from_flat(arm="ptq-46")


def test_each_arm_states_its_rollout():
  """The rollout an arm runs (precision, capture, guided layers, routing), by hand: FP4
  arms that train in FP4 capture at least compact guidance on every layer (the per-layer
  disagreement is measured each step), others capture what they train on."""
  base = RolloutConfig(max_len=64)
  expected = {  # name: (precision, guidance captured, its layers, routing recorded: always)
    "bf16": ("bf16", "none", "none", True),
    "fp4-rollout": ("fp4", "none", "none", True),
    "fp4-qat": ("fp4", "compact", "all", True),
    "trace": ("fp4", "compact", "all", True),
    "trace-full": ("fp4", "full", "all", True),
    "trace-sparse": ("fp4", "sparse", "all", True),
    "ptq": ("bf16", "none", "none", True),
    "ptq-46": ("bf16", "none", "none", True),
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
  assert RLConfig.from_flat(arm="fp4-rollout").loss_config.rollout_correction == "tis"
  assert RLConfig.from_flat(arm="trace", correction="mask").loss_config.rollout_correction == "mask"
  with pytest.raises(ValueError, match="one knob, RLConfig.correction"):
    RLConfig(loss=LossConfig(rollout_correction="tis"))
  # A config saved before the knob was one (its LossConfig said "tis") still resumes.
  saved = RLConfig().to_dict()
  saved["loss"] = {**saved["loss"], "rollout_correction": "tis"}
  assert RLConfig().differences(saved) == []


# The default RLConfig as the flat RLConfig (before the sections) saved it in checkpoints;
# the main job's defaults have moved since (SAVED_FLAT: those settings in today's config).
FLAT = {
  "arm": "trace", "fp4_sites": "all", "fmt": "nvfp4", "activations": "fp4", "sparse_delta": 0.07,
  "task": "chain", "task_options": [], "preset": "small", "seed": 0, "steps": 100,
  "prompts_per_step": 8, "group_size": 16, "max_new_tokens": 32, "temperature": 0.7,
  "learning_rate": 3e-05, "lr_warmup_steps": 0, "minibatches": 1, "epochs": 1,
  "loss": {
    "clip_low": 0.2, "clip_high": 0.28, "aggregation": "token", "std_norm": True,
    "kl_coef": 0.0, "rollout_correction": "none", "tis_threshold": 2.0,
  },
  "correction": "auto", "compute_dtype": "bfloat16", "prompt_bucket": 0, "eval_every": 20,
  "eval_size": 512, "checkpoint_every": 20, "sft_steps": 100, "sft_batch": 32,
  "sft_learning_rate": 0.003, "mesh": [1, 1, 1], "max_param_abs": 10000.0,
  "hf_checkpoint": "", "sft_warm_start": None, "prompt_format": "auto", "system_prompt": "",
  "observation_role": "user", "chat_template_options": [], "remat": False,
  "reward_control": "none",
}  # fmt: skip
# what FLAT ran with: its fields, and BEFORE_ADDED's values of the fields added since
SAVED_FLAT = RLConfig.from_flat(
  task="chain", learning_rate=3e-5, sft_steps=100, std_norm=True, steps=100, temperature=0.7
).replace(sft_target=0.0, lr_decay="constant", prefill_chunk=0, mesh=(1, 1, 1))


def test_a_config_saved_flat_compares_by_leaf_name():
  """Run dirs saved before the sections resume: their flat config compares field by field
  with the nested one, names a changed field by its flat name, and rebuilds the config."""
  assert SAVED_FLAT.differences(FLAT) == []
  assert RLConfig.from_dict(FLAT) == SAVED_FLAT
  assert RLConfig().differences(FLAT) == [
    "learning_rate",
    "lr_decay",
    "sft_steps",
    "std_norm",
    "task",
    "temperature",
  ]
  changed = SAVED_FLAT.replace(group_size=4, fp4_sites="experts+kv", kl_coef=0.01, mesh=(2, 1, 1))
  assert changed.differences(FLAT) == ["fp4_sites", "group_size", "kl_coef", "mesh"]
  assert RLConfig.from_dict(changed.to_dict()) == changed
  legacy = {**FLAT, "group_size": 4, "fp4_sites": "experts+kv", "mesh": [2, 1, 1]}
  legacy["loss"] = {**FLAT["loss"], "kl_coef": 0.01}
  assert RLConfig.from_dict(legacy) == changed and changed.differences(legacy) == []
  # steps, max_param_abs, remat and tensorboard may change on a resume
  assert changed.replace(steps=7, remat=True, tensorboard=False).differences(FLAT) == [
    "fp4_sites",
    "group_size",
    "kl_coef",
    "mesh",
  ]
  assert changed.replace(steps=7, remat=True).differences(changed.to_dict()) == []
  assert changed.replace(scan_layers=False).differences(changed.to_dict()) == []
  # and so may the learner's wait for a batch
  assert changed.replace(rollout_timeout=5.0).differences(changed.to_dict()) == []
  assert changed.replace(rollout_devices=2).differences(changed.to_dict()) == ["rollout_devices"]
  # and so may the prefill's chunk
  assert changed.replace(prefill_chunk=7).differences(changed.to_dict()) == []


def test_the_leaves_have_unique_flat_names_and_the_sections_validate():
  leaves = config_flags.flat_fields(RLConfig)
  # the flat config's names, and the knobs added since (asynchronous RL, lr_decay, sft_target)
  added = {"max_staleness", "is_cap", "is_cap_mode", "version_diag_every", "lr_decay"}
  added |= {"sft_target", "kv_precision", "max_grad_norm", "tensorboard", "rollout_skew"}
  added |= {"rollout_devices", "rollout_timeout", "scan_layers", "prefill_chunk"}
  added |= {"wandb", "wandb_project", "geo_threshold", "rollout_slots"}
  # the scheme's per-path fields: leaves of the run's QuantConfig, never flags
  added |= {"fp4_precision", "fp4_weights", "fp4_rounding", "fp4_guided_layers"}
  assert set(leaves) == set(config_flags.flatten(RLConfig, FLAT)) | added
  assert leaves["fp4_sites"][0] == ("fp4", "sites") and leaves["steps"][0] == ("schedule", "steps")
  config = RLConfig.from_flat(steps=3, temperature=0.5, preset="tiny")
  assert (config.schedule.steps, config.sampling.temperature, config.source.preset) == (
    3,
    0.5,
    "tiny",
  )
  assert config.replace(fmt="nvfp4", group_size=2).sampling.group_size == 2
  with pytest.raises(ValueError, match=r"has no fields \['stepz'\]"):
    RLConfig.from_flat(stepz=3)
  with pytest.raises(ValueError, match="RLConfig.group_size=0 must be >= 1"):
    RLConfig.from_flat(group_size=0)


def _script_flags(name: str) -> dict:
  """{flag: default} of the flags experiments/<name>.py defines (absl's global FLAGS)."""
  return load_script(name)[1]


def test_rl_script_flags_are_the_config_fields():
  """Every flag experiments/rl.py had keeps its name and default; the defaults are the
  config classes' own (written out here by hand, as the flat RLConfig had them)."""
  defaults = _script_flags("rl")
  expected = {k: v for k, v in FLAT.items() if k not in ("loss", "correction", "activations")}
  expected.update({k: v for k, v in FLAT["loss"].items() if k != "rollout_correction"})
  expected.update(activations="fp4", rollout_correction="auto", workdir=None)
  expected.update(coordinator_address=None, num_processes=None, process_id=None)
  expected.update(learning_rate=8e-5, sft_steps=200, std_norm=False)  # the main job's, since
  expected.update(steps=150, temperature=1.0, sft_target=0.0, lr_decay="cosine")
  expected.update(task="chain_flawed", mesh=[-1, 1, 1])  # all devices by default, since
  for name, value in expected.items():
    if isinstance(value, list):  # list flags: strings
      value = [str(v) for v in value]
    assert name in defaults and defaults[name] == value, name


def test_asynchronous_rl_knobs_are_flags_and_validate():
  """--max_staleness, --is_cap, --is_cap_mode and --version_diag_every come from the config
  fields (defaults: the synchronous loop, AReaL's cap 5 as a mask, no diagnostic); bad
  values fail naming the field, the value and what is allowed."""
  defaults = _script_flags("rl")
  assert {k: defaults[k] for k in ("max_staleness", "is_cap", "is_cap_mode")} == {
    "max_staleness": 0,
    "is_cap": 5.0,
    "is_cap_mode": "mask",
  }
  assert defaults["version_diag_every"] == 0
  assert flags.FLAGS["is_cap_mode"].parser.enum_values == ["mask", "clamp"]
  config = RLConfig.from_flat(max_staleness=3, is_cap=2.5, is_cap_mode="clamp")
  assert config.schedule.max_staleness == 3
  assert (config.decoupled.is_cap, config.decoupled.is_cap_mode) == (2.5, "clamp")
  cases = [
    (dict(max_staleness=-1), r"RLConfig.max_staleness=-1 must be >= 0"),
    (dict(max_staleness=1.5), r"RLConfig.max_staleness=1.5 must be an integer >= 0"),
    (dict(is_cap=0.0), r"DecoupledConfig.is_cap=0.0 must be a finite number > 0"),
    (dict(is_cap=float("inf")), r"DecoupledConfig.is_cap=inf must be a finite number > 0"),
    (dict(is_cap_mode="drop"), r"is_cap_mode='drop' is not allowed; use one of \('mask', "),
    (dict(version_diag_every=-2), r"RLConfig.version_diag_every=-2 must be >= 0"),
  ]
  for values, message in cases:
    with pytest.raises(ValueError, match=message):
      RLConfig.from_flat(**values)
  # A checkpoint saved before the knobs existed resumes (they count as their defaults) and
  # one of another staleness is refused by name.
  saved = {k: v for k, v in RLConfig().to_dict().items() if k != "decoupled"}
  del saved["schedule"]["max_staleness"]
  assert RLConfig().differences(saved) == []
  assert RLConfig.from_flat(max_staleness=2).differences(saved) == ["max_staleness"]


def test_a_decay_with_no_step_after_the_warmup_is_refused_before_any_work():
  """lr_decay falls after the warmup: steps <= lr_warmup_steps leaves it no step, a ValueError
  naming both (at the CLI, one line). A constant rate, or 0 steps (a warm start only), pass."""
  for steps, warmup in ((4, 4), (2, 6)):
    with pytest.raises(
      ValueError,
      match=rf"lr_decay='cosine'.*steps={steps} <= lr_warmup_steps={warmup}.*--lr_decay=constant",
    ):
      RLConfig.from_flat(steps=steps, lr_warmup_steps=warmup, lr_decay="cosine")
  RLConfig.from_flat(steps=4, lr_warmup_steps=4, lr_decay="constant")
  RLConfig.from_flat(steps=0, lr_warmup_steps=4, lr_decay="linear")
  RLConfig.from_flat(steps=5, lr_warmup_steps=4, lr_decay="linear")


# What each run-level scheme field allows, from the formats' and scopes' own definitions.
_ALLOWED = {
  "fmt": tuple(fp4.FORMATS),
  "sites": quant_lib.SITE_SCOPES,
  "activations": quant_lib.ACTIVATION_FORMATS,
  "kv": quant_lib.KV_PRECISIONS,
}


def _scheme_values(field) -> list:
  """Every value the scheme's field allows other than its default."""
  return [v for v in _ALLOWED[field.name] if v != field.default]


def test_every_scheme_field_a_run_states_reaches_both_paths():
  """One scheme type: each field of a run's QuantConfig that is not a path's own reaches the
  training path (`RLConfig.train_quant`, every FP4 training arm) and the rollout
  (`RolloutConfig.quant` of the run's rollout configs) with nothing copied by hand: the
  fields are enumerated from the dataclass, so a new option is checked without touching
  this test. The per-path fields are refused in a run's scheme, naming the field; they
  are no flags."""
  from trace_jax.rl import episodes  # noqa: PLC0415
  from trace_jax.run import policy_source  # noqa: PLC0415
  from trace_jax.tasks import get_task  # noqa: PLC0415

  fields = [f for f in dataclasses.fields(QuantConfig) if f.name not in quant_lib.PATH_FIELDS]
  assert {f.name for f in fields} == set(_ALLOWED)  # a new field needs its allowed values here
  rng = np.random.default_rng()
  for field in fields:
    value = _scheme_values(field)[rng.integers(len(_scheme_values(field)))]
    flat = config_flags.flat_name(field)
    for arm in ("fp4-qat", "trace", "trace-full"):
      config = RLConfig.from_flat(arm=arm, preset="small", **{flat: value})
      assert getattr(config.train_quant, field.name) == value, (arm, flat)
      assert config.train_quant == ARMS[arm].train_scheme(config.fp4)
      task = get_task(config.task)
      source = policy_source.load(config, task, weights=False)
      sampling, greedy = episodes.rollout_configs(config, task, source)
      for rollout in (sampling, greedy, ARMS[arm].rollout(sampling)):
        assert getattr(rollout.quant, field.name) == value, (arm, flat)
  script = _script_flags("rl")
  for field in quant_lib.PATH_FIELDS:
    flat = config_flags.flat_name(QuantConfig.__dataclass_fields__[field])
    assert flat not in script
    value = {"precision": "bf16", "weights": False, "rounding": "guided"}.get(field, "all")
    with pytest.raises(ValueError, match=rf"RLConfig.fp4.{field}={value!r} is not allowed"):
      RLConfig.from_flat(**{flat: value})


def test_rollout_skew_is_a_flag_saved_with_the_config_and_refused_by_name():
  """--rollout_skew (default 0: no skew) comes from the field, is saved and compared like
  every field (a run saved before it read as 0), reaches the arm's rollouts only, and a
  negative, non-finite or rollout-free skew is refused naming the field and the value."""
  assert _script_flags("rl")["rollout_skew"] == 0.0 and RLConfig().rollout_skew == 0.0
  skewed = RLConfig.from_flat(rollout_skew=2**-7)
  assert skewed.to_dict()["rollout_skew"] == 2**-7
  assert RLConfig.from_dict(skewed.to_dict()) == skewed
  old = RLConfig().to_dict()
  del old["rollout_skew"]
  assert RLConfig().differences(old) == [] and skewed.differences(old) == ["rollout_skew"]
  for bad in (-0.01, float("nan"), float("inf"), -float("inf")):
    with pytest.raises(ValueError, match=r"RLConfig\.rollout_skew=.* finite number >= 0"):
      RLConfig.from_flat(rollout_skew=bad)
  with pytest.raises(ValueError, match=r"RLConfig\.rollout_skew=0\.01 .* steps=0 runs none"):
    RLConfig.from_flat(rollout_skew=0.01, steps=0)
  RLConfig.from_flat(rollout_skew=0.0, steps=0)  # no skew: a warm start only, as before
  for arm in RUNNABLE:  # every runnable arm rolls out (ptq: the bf16 run it packs)
    assert RLConfig.from_flat(arm=arm, rollout_skew=0.01).rollout_skew == 0.01


def test_prefill_chunk_is_a_flag_the_rollouts_take():
  """--prefill_chunk (default 128, RolloutConfig's) reaches the step's and the evaluation's
  rollouts; a run saved before the knob existed fed whole prompts (reads as 0); a negative
  chunk fails naming the field before any work."""
  from trace_jax.rl import episodes  # noqa: PLC0415
  from trace_jax.run import policy_source  # noqa: PLC0415
  from trace_jax.tasks import get_task  # noqa: PLC0415

  assert _script_flags("rl")["prefill_chunk"] == RolloutConfig().prefill_chunk == 128
  chunk = int(np.random.default_rng().integers(0, 64))
  config = RLConfig.from_flat(preset="tiny", prefill_chunk=chunk)
  task = get_task(config.task)
  source = policy_source.load(config, task, weights=False)
  configs = episodes.rollout_configs(config, task, source)
  assert {c.prefill_chunk for c in configs} == {chunk}
  assert RLConfig.from_dict(FLAT).sampling.prefill_chunk == 0
  with pytest.raises(ValueError, match=r"RLConfig.prefill_chunk=-1 must be >= 0"):
    RLConfig.from_flat(prefill_chunk=-1)


@pytest.mark.parametrize("std_norm", [False, True])
def test_a_group_of_one_sample_is_refused_by_name(std_norm):
  """One sample per group leaves every GRPO advantage 0 (with or without the std division),
  so such a run could never learn: refused naming group_size and what is allowed."""
  from trace_jax.rl.grpo import group_advantages

  rewards = np.random.default_rng(0).random(6).astype(np.float32)
  assert not np.any(np.asarray(group_advantages(rewards, 1, std_norm=std_norm)))
  with pytest.raises(ValueError, match=r"RLConfig.group_size=1 .* use group_size >= 2"):
    RLConfig.from_flat(group_size=1, std_norm=std_norm)
  assert RLConfig.from_flat(group_size=2, std_norm=std_norm).sampling.group_size == 2


def test_a_temperature_below_the_floor_is_refused_naming_the_floor():
  """A temperature of 1e-30 scales the two paths' log-probs by 1e30 (IS ratio inf, k3 NaN):
  refused naming the value and the floor; the floor itself is a run's temperature."""
  from trace_jax.rl.config import MIN_TEMPERATURE

  for value in (1e-30, MIN_TEMPERATURE / 2):
    with pytest.raises(
      ValueError, match=rf"RLConfig.temperature={value!r} is below the floor 0.01"
    ):
      RLConfig.from_flat(temperature=value)
  assert RLConfig.from_flat(temperature=MIN_TEMPERATURE).sampling.temperature == MIN_TEMPERATURE


def test_a_mesh_axis_of_minus_one_takes_the_devices_left():
  """--mesh's -1 (MaxText's convention) is the devices the other axes leave: all of them by
  default (one CPU device: the 1,1,1 of before), those after --rollout_devices otherwise;
  a mesh a resumed run recorded is kept where the spec allows it and the devices hold it."""
  default = RLConfig.from_flat(preset="tiny")
  assert default.mesh == (-1, 1, 1)
  assert default.on_devices(1) == RLConfig.from_flat(preset="tiny", mesh=(1, 1, 1))
  assert default.on_devices(8).mesh == (8, 1, 1)
  small = dict(preset="tiny", prompts_per_step=3, group_size=4)  # a batch of 12
  assert RLConfig.from_flat(**small, rollout_devices=2).on_devices(8).mesh == (6, 1, 1)
  assert RLConfig.from_flat(**small, mesh=(2, -1, 1)).on_devices(8).mesh == (2, 4, 1)
  assert RLConfig.from_flat(**small, mesh=(3, 1, 1)).on_devices(8).mesh == (3, 1, 1)
  assert default.on_devices(8, recorded=(1, 1, 1)).mesh == (1, 1, 1)  # a resumed run's
  assert default.on_devices(8, recorded=(2, 2, 1)).mesh == (8, 1, 1)  # not the spec's
  assert default.on_devices(8, recorded=(16, 1, 1)).mesh == (8, 1, 1)  # more than there are
  # a saved config compares with a -1 spec on the other axes
  assert default.differences(default.on_devices(8).to_dict()) == []
  assert default.differences({**default.to_dict(), "mesh": [2, 2, 1]}) == ["mesh"]
  flat = RLConfig.flat_dict(default.to_dict(), devices=4)
  assert flat["mesh"] == [4, 1, 1] and RLConfig.flat_dict(default.to_dict())["mesh"] == [-1, 1, 1]


@pytest.mark.parametrize(
  "overrides, devices, match",
  [
    (dict(mesh=(-1, -1, 1)), 8, r"RLConfig.mesh=\(-1, -1, 1\) has 2 axes of -1; at most one"),
    (dict(mesh=(-2, 1, 1)), 8, r"RLConfig.mesh=\(-2, 1, 1\) must be .* each >= 1 or -1"),
    (dict(mesh=(-1, 3, 1)), 8, r"RLConfig.mesh=\(-1, 3, 1\): .* 8 devices do not divide by .*3"),
    (dict(rollout_devices=4), 4, r"RLConfig.rollout_devices=4 leaves the learner 0 of .* 4 dev"),
    (
      dict(prompts_per_step=8, group_size=16, rollout_devices=2),
      8,
      r"RLConfig.mesh=\(-1, 1, 1\) is \(6, 1, 1\) on the 6 devices after rollout_devices=2: "
      r"RLConfig: batch 128 and its minibatches must divide over 6 data-parallel devices; "
      r"allowed: prompts_per_step x group_size a multiple of 6 .*divides 128",
    ),
  ],
)
def test_a_mesh_the_devices_cannot_hold_is_refused_by_name(overrides, devices, match):
  with pytest.raises(ValueError, match=match):
    RLConfig.from_flat(preset="tiny", **overrides).on_devices(devices)


def test_rollout_slots_is_a_flag_that_reaches_every_engine_and_is_refused_by_name():
  """--rollout_slots (default 0: the static batch) becomes RolloutConfig.slots of the run's
  sampling and greedy engines (None for 0); a resume may change it; a negative count, or a
  pool whose slots do not split over the mesh's data axis, is refused naming the field."""
  from trace_jax.rl import episodes  # noqa: PLC0415
  from trace_jax.run import policy_source  # noqa: PLC0415
  from trace_jax.tasks import get_task  # noqa: PLC0415

  assert _script_flags("rl")["rollout_slots"] == 0 and RLConfig().sampling.rollout_slots == 0
  for slots, expected in ((0, None), (8, 8)):
    config = RLConfig.from_flat(rollout_slots=slots)
    task = get_task(config.task)
    source = policy_source.load(config, task, weights=False)
    assert [c.slots for c in episodes.rollout_configs(config, task, source)] == [expected] * 2
  old = RLConfig().to_dict()
  assert RLConfig.from_flat(rollout_slots=8).differences(old) == []  # resumable
  with pytest.raises(ValueError, match=r"RLConfig.rollout_slots=-1 must be >= 0"):
    RLConfig.from_flat(rollout_slots=-1)
  with pytest.raises(
    ValueError, match=r"RLConfig.rollout_slots=3 with mesh=\[2, 1, 1\]: .*multiple of 2"
  ):
    RLConfig.from_flat(rollout_slots=3, mesh=(2, 1, 1))
  assert RLConfig.from_flat(rollout_slots=8, mesh=(2, 1, 1)).sampling.rollout_slots == 8
