"""One RL step per arm, checking what each arm promises as observed in its outputs (slow:
`pytest -m slow tests/rl/test_arms.py`, a few minutes on 2 cores)."""

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax.rl.config import RLConfig
from trace_jax.rl.trainer import Trainer

# arm: (rollout packs FP4 weights, training quantizes, rounding, correction, guidance mode,
#       guided layers of the tiny model, routing replay)
PROMISES = {
  "bf16": (False, False, None, "none", None, (), False),
  "fp4-rollout": (True, False, None, "tis", None, (), False),
  "fp4-qat": (True, True, "nearest", "none", None, (), False),
  "trace": (True, True, "guided", "none", "compact", (1,), True),
  "trace-full": (True, True, "guided", "none", "full", (0, 1), True),
  "trace-sparse": (True, True, "guided", "none", "sparse", (0, 1), True),
}


def _packed(params) -> bool:
  return any(
    isinstance(leaf, fp4.QArray)
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, fp4.QArray))
  )


# Every arm in the full scope, and the method's own scope for the FP4-trained arms. (MXFP4
# needs widths in multiples of 32; the tiny preset's heads are 16 wide, so MXFP4 runs on
# `small`: test_one_mxfp4_step_on_a_preset_that_fits.)
CASES = [(arm, "all") for arm in sorted(PROMISES)] + [
  ("fp4-qat", "experts+kv"),
  ("trace", "experts+kv"),
]


@pytest.mark.slow
@pytest.mark.parametrize("arm, fp4_sites", CASES)
def test_one_step_keeps_the_arms_promises(tmp_path, arm, fp4_sites, fmt="nvfp4"):
  packs, quantized, rounding, correction, mode, layers, replay = PROMISES[arm]
  config = RLConfig(
    arm=arm,
    task="arith",
    preset="tiny",
    steps=1,
    prompts_per_step=2,
    group_size=4,
    minibatches=2,
    max_new_tokens=6,
    sft_steps=0,
    eval_every=0,
    eval_size=0,
    checkpoint_every=0,
    fp4_sites=fp4_sites,
    fmt=fmt,
  )
  trainer = Trainer(config, str(tmp_path), progress=False)
  # Rollout precision: packed FP4 weights (in the run's format and scope) or bf16 weights.
  assert _packed(trainer.engine.params) == packs
  if packs:
    packed = [
      leaf
      for leaf in jax.tree.leaves(
        trainer.engine.params, is_leaf=lambda x: isinstance(x, fp4.QArray)
      )
      if isinstance(leaf, fp4.QArray)
    ]
    assert {q.fmt for q in packed} == {fmt}
    # experts+kv packs only the routed experts (3 per MoE layer); "all" packs 7 per layer.
    assert len(packed) == (6 if fp4_sites == "experts+kv" else 14)
    assert trainer.engine.config.fp4_sites == fp4_sites
  # The training path's quantization and rounding.
  quant = config.train_quant
  assert (quant is not None) == quantized
  if quant is not None:
    assert (quant.rounding, quant.sites, quant.fmt) == (rounding, fp4_sites, fmt)
  assert config.loss_config.rollout_correction == correction

  metrics = trainer.train_step()
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["mismatch/k3_kl"])
  # Guidance: bytes only for guided arms.
  if mode is None:
    assert metrics["guidance/bytes_per_token"] == 0
    assert "guidance/followed_frac" not in metrics
  else:
    assert metrics["guidance/bytes_per_token"] > 0
    assert 0.5 < metrics["guidance/followed_frac"] <= 1
  # Both paths FP4: per-layer bit and scale disagreement every step; codes with full capture.
  # A sparse capture records bits and scales only near boundaries: its densities instead.
  if mode == "sparse":
    assert 0 < metrics["guidance/sparse_density"] < 0.5
    assert metrics["guidance/sparse_overflow"] >= 0
    assert "mismatch/mantissa_disagree_frac" not in metrics
  elif packs and quantized:
    for layer in (0, 1):
      assert 0 <= metrics[f"mismatch/mantissa_disagree/layer_{layer}"] <= 1
      assert 0 <= metrics[f"mismatch/scale_disagree/layer_{layer}"] <= 1
    assert ("mismatch/code_disagree_frac" in metrics) == (mode == "full")
  else:
    assert "mismatch/mantissa_disagree_frac" not in metrics
  if mode == "full":  # full guidance on every layer with replay reproduces nearly every code
    assert metrics["mismatch/code_disagree_frac"] < 0.01
  assert trainer.guided_layers == layers
  # Routing replay: the rollout records routing exactly when the arm replays it.
  assert trainer.engine.config.record_routing == replay
  if not packs:  # bf16 rollout: router and LM head stay float32, as in the FP4 arms
    state = {
      ".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(trainer.engine.params)
    }
    assert state["lm_head"].dtype == np.float32 and state["blocks.1.moe.router"].dtype == np.float32


def test_arm_scope_and_format_reach_the_training_path():
  config = RLConfig(arm="trace", fp4_sites="experts+kv", fmt="mxfp4")
  assert (config.train_quant.sites, config.train_quant.fmt) == ("experts+kv", "mxfp4")
  assert config.train_quant.rounding == "guided"
  assert RLConfig(arm="fp4-rollout", fmt="mxfp4").train_quant is None


@pytest.mark.slow
@pytest.mark.parametrize(
  "arm, fp4_sites, activations",
  [("trace", "all", "fp4"), ("fp4-qat", "experts+kv", "fp4"), ("trace", "all", "fp8")],
)
def test_one_mxfp4_step_on_a_preset_that_fits(tmp_path, arm, fp4_sites, activations):
  """--fmt=mxfp4 end to end: MXFP4 rollout weights (E8M0 scales, no global scale), MXFP4 KV
  cache, MXFP4 QAT, guidance captured in the MXFP4 layout; and W4A8 (--activations=fp8:
  linear inputs in MXFP8 E4M3, guidance on the FP4 KV cache only)."""
  config = RLConfig(
    arm=arm,
    task="arith",
    preset="small",
    steps=1,
    prompts_per_step=1,
    group_size=2,
    minibatches=1,
    max_new_tokens=4,
    sft_steps=0,
    eval_every=0,
    eval_size=0,
    checkpoint_every=0,
    fp4_sites=fp4_sites,
    fmt="mxfp4",
    activations=activations,
  )
  trainer = Trainer(config, str(tmp_path), progress=False)
  packed = [
    leaf
    for leaf in jax.tree.leaves(trainer.engine.params, is_leaf=lambda x: isinstance(x, fp4.QArray))
    if isinstance(leaf, fp4.QArray)
  ]
  assert packed and {q.fmt for q in packed} == {"mxfp4"}
  assert all(np.all(np.asarray(q.global_scale) == 1) for q in packed)  # MXFP4: none
  assert config.train_quant.fmt == "mxfp4"
  metrics = trainer.train_step()
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["mismatch/k3_kl"])
  for layer in range(trainer.model_cfg.num_layers):
    assert 0 <= metrics[f"mismatch/scale_disagree/layer_{layer}"] <= 1
  if arm == "trace":
    assert metrics["guidance/bytes_per_token"] > 0
  assert trainer.engine.config.quant.activations == activations
  if activations == "fp8":  # guidance holds the K/V sites only
    captured = trainer.engine.generate([[5, 6, 7]], jax.random.key(0)).guidance
    assert {site for _, site in captured.sites} == {"k", "v"}


def test_mxfp4_on_a_preset_too_narrow_names_the_field_and_presets_that_fit():
  with pytest.raises(ValueError, match=r"fmt='mxfp4'.*preset='tiny' has head_dim=16.*'small'"):
    RLConfig(preset="tiny", fmt="mxfp4")
  with pytest.raises(ValueError, match=r"preset='qwen3_5_tiny' has head_dim=16"):
    RLConfig(preset="qwen3_5_tiny", fmt="mxfp4", fp4_sites="experts+kv")
  RLConfig(preset="tiny", fmt="nvfp4")  # 16-element NVFP4 blocks fit
