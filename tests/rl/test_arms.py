"""One RL step per arm, checking what each arm promises as observed in its outputs (slow:
`pytest -m slow tests/rl/test_arms.py`, a few minutes on 2 cores)."""

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax.rl import step as step_lib
from trace_jax.rl.config import RLConfig
from trace_jax.run.policy_source import preflight
from trace_jax.run.trainer import Trainer

# arm: (rollout packs FP4 weights, training quantizes, rounding, correction, guidance mode,
#       guided layers of the tiny model, routing replay)
PROMISES = {
  "bf16": (False, False, None, "none", None, (), False),
  "fp4-rollout": (True, False, None, "tis", None, (), False),
  "fp4-qat": (True, True, "nearest", "none", None, (), False),
  "fp4-qat-r3": (True, True, "nearest", "none", None, (), True),
  "trace": (True, True, "guided", "none", "compact", (1,), True),
  "trace-full": (True, True, "guided", "none", "full", (0, 1), True),
  "trace-sparse": (True, True, "guided", "none", "sparse", (0, 1), True),
}


def _packed(params) -> bool:
  return any(
    isinstance(leaf, fp4.QArray)
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, fp4.QArray))
  )


def _rows(mask, shape):
  """The [B, S] real-token mask broadcast over the row axes of a site array [B, S, ..., n]."""
  mask = np.asarray(mask, bool)
  return np.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - 3)), shape[:-1])


def _disagreement_by_hand(rollout_sites, train_sites, mask) -> dict:
  """Per layer, counted here from the two paths' records at the real tokens: the shares of
  elements whose mantissa bit (bit 0 of the code) differs, of blocks whose scale (block or
  the row's global scale) differs and, where the rollout holds codes, of elements whose
  code differs."""
  counts = {}  # layer -> [bits differ, bits, blocks differ, blocks, codes differ, codes]
  for key, r in rollout_sites.items():
    t = train_sites[key]
    rows = _rows(mask, t.shape)
    t_codes = np.asarray(fp4.codes(t))[rows]  # [rows, n]
    if isinstance(r, fp4.QArray):
      r_codes = np.asarray(fp4.codes(r))[rows]
      r_bits = r_codes & 1
    else:
      r_codes, r_bits = None, np.asarray(fp4.unpack_bits(r.mantissa_bits))[rows]
    block_differs = (np.asarray(r.scales)[rows] != np.asarray(t.scales)[rows]) | (
      np.asarray(r.global_scale)[rows] != np.asarray(t.global_scale)[rows]
    )
    c = counts.setdefault(key[0], [0] * 6)
    c[0] += int(np.sum(r_bits != (t_codes & 1)))
    c[1] += t_codes.size
    c[2] += int(np.sum(block_differs))
    c[3] += block_differs.size
    if r_codes is not None:
      c[4] += int(np.sum(r_codes != t_codes))
      c[5] += t_codes.size
  return {
    layer: {
      "mantissa": c[0] / c[1],
      "scale": c[2] / c[3],
      "code": c[4] / c[5] if c[5] else None,
    }
    for layer, c in counts.items()
  }


def _fallback_share(fallbacks, mask, layers=None) -> tuple[int, int]:
  """(fallbacks, guided elements) at the real tokens, over `layers` (None: all)."""
  fell = total = 0
  for (layer, _), value in fallbacks.items():
    if layers is None or layer in layers:
      value = np.asarray(value)
      rows = _rows(mask, value.shape)
      fell += int(np.sum(value[rows]))
      total += value[rows].size
  return fell, total


def _guidance_bytes_per_token(
  cfg, layers, mode: str, fp4_sites: str, replay: bool, fp4_kv: bool = True
) -> int:
  """Compact or full guidance bytes per token, derived from the model's shapes: per site
  and token, the element bits (1 compact, 4 full), one E4M3 byte per 16 elements and a
  4-byte global scale per row (a token; a (token, KV head); a (token, chosen expert)), and
  one routing byte per MoE layer and chosen expert."""
  kv = cfg.num_kv_heads * cfg.head_dim
  sites = {  # name: (elements per token, rows per token)
    "attn_in": (cfg.d_model, 1),
    "attn_out": (cfg.num_heads * cfg.head_dim, 1),
    "k": (kv, cfg.num_kv_heads),
    "v": (kv, cfg.num_kv_heads),
    "moe_in": (cfg.d_model, 1),
    "moe_mid": (cfg.num_experts_per_tok * cfg.moe_ffn_dim, cfg.num_experts_per_tok),
  }
  if fp4_sites == "experts+kv":
    sites = {k: v for k, v in sites.items() if k not in ("attn_in", "attn_out")}
  if not fp4_kv:  # --kv_precision=bf16: K and V are not FP4, so not guided
    sites = {k: v for k, v in sites.items() if k not in ("k", "v")}
  bits = {"compact": 1, "full": 4}[mode]
  per_layer = sum(n * bits // 8 + n // 16 + 4 * rows for n, rows in sites.values())
  routing = cfg.num_moe_layers * cfg.num_experts_per_tok if replay else 0  # int8 ids
  return len(layers) * per_layer + routing


# Every arm in the full scope, and the method's own scope for the FP4-trained arms. (MXFP4
# needs widths in multiples of 32; the tiny preset's heads are 16 wide, so MXFP4 runs on
# `small`: test_one_mxfp4_step_on_a_preset_that_fits.)
CASES = [(arm, "all") for arm in sorted(PROMISES)] + [
  ("fp4-qat", "experts+kv"),
  ("trace", "experts+kv"),
]


def _spy_on_the_step(monkeypatch, captured: dict) -> None:
  """Keep the step's rollout (`collected`) and training path (`scored`) as the trainer's
  metrics line reads them."""
  real = step_lib.step_metrics

  def spy(spec, step, collected, done, engine):
    captured.update(collected=collected, scored=done.scored)
    return real(spec, step, collected, done, engine)

  monkeypatch.setattr(step_lib, "step_metrics", spy)


@pytest.mark.slow
@pytest.mark.parametrize("arm, fp4_sites", CASES)
def test_one_step_keeps_the_arms_promises(tmp_path, monkeypatch, arm, fp4_sites, fmt="nvfp4"):
  packs, quantized, rounding, correction, mode, layers, replay = PROMISES[arm]
  config = RLConfig.from_flat(
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
    assert trainer.engine.config.fp4.sites == fp4_sites
  # The training path's quantization and rounding.
  quant = config.train_quant
  assert (quant is not None) == quantized
  if quant is not None:
    assert (quant.rounding, quant.sites, quant.fmt) == (rounding, fp4_sites, fmt)
  assert config.loss_config.rollout_correction == correction

  captured = {}
  _spy_on_the_step(monkeypatch, captured)
  metrics = trainer.train_step()
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["mismatch/k3_kl"])
  rollout, scored = captured["collected"].rollout, captured["scored"]
  mask = np.asarray(rollout.mask)
  cfg = trainer.model_cfg
  # Guidance: bytes only for guided arms; compact and full from the model's shapes.
  if mode is None:
    assert metrics["guidance/bytes_per_token"] == 0
    assert "guidance/followed_frac" not in metrics
  else:
    full_bytes = _guidance_bytes_per_token(cfg, layers, "full", fp4_sites, replay)
    if mode in ("compact", "full"):
      assert metrics["guidance/bytes_per_token"] == pytest.approx(
        _guidance_bytes_per_token(cfg, layers, mode, fp4_sites, replay)
      )
    else:  # measured on the data: some bytes, fewer than full guidance of the same layers
      assert 0 < metrics["guidance/bytes_per_token"] < full_bytes
    fell, total = _fallback_share(scored.fallbacks, mask)
    assert total > 0
    assert metrics["guidance/followed_frac"] == pytest.approx(1 - fell / total)
    assert metrics["guidance/fallbacks"] == fell
    assert metrics["guidance/followed_frac"] > 0.5
  # Both paths FP4: per-layer bit and scale disagreement every step; codes with full capture.
  # A sparse capture records bits and scales only near boundaries: its densities instead.
  if mode == "sparse":
    flagged = elements = blocks_flagged = blocks = overflow = 0
    for g in rollout.guidance.sites.values():
      rows = _rows(mask, g.count.shape)
      count, block_count = np.asarray(g.count)[rows], np.asarray(g.block_count)[rows]
      flagged += int(count.sum())
      elements += count.size * g.n
      blocks_flagged += int(block_count.sum())
      blocks += count.size * (g.n // 16)
      overflow += int(np.maximum(count - g.capacity, 0).sum())
    assert metrics["guidance/sparse_density"] == pytest.approx(flagged / elements)
    assert metrics["guidance/sparse_block_density"] == pytest.approx(blocks_flagged / blocks)
    assert metrics["guidance/sparse_overflow"] == overflow
    assert 0 < flagged / elements < 0.5
    assert "mismatch/mantissa_disagree_frac" not in metrics
  elif packs and quantized:
    by_hand = _disagreement_by_hand(rollout.guidance.sites, scored.train_sites, mask)
    assert sorted(by_hand) == [0, 1]  # every layer measured, guided or not
    for layer, row in by_hand.items():
      for kind in ("mantissa", "scale", "code"):
        name = f"mismatch/{kind}_disagree/layer_{layer}"
        if row[kind] is None:
          assert name not in metrics
        else:
          assert metrics[name] == pytest.approx(row[kind]), name
      if layer in layers:  # guided: the rollout's scales; its bit or code unless fallen back
        fell, total = _fallback_share(scored.fallbacks, mask, layers=(layer,))
        assert row["scale"] == 0
        if mode == "compact":  # a differing bit is exactly a fallback (one forced neighbour)
          assert row["mantissa"] == pytest.approx(fell / total)
        else:  # a fallback always changes the code; a followed code differs only in sign
          assert row["mantissa"] <= fell / total + 1e-12 <= row["code"] + 2e-12
          assert row["code"] - fell / total < 1e-3
    assert ("mismatch/code_disagree_frac" in metrics) == (mode == "full")
  else:
    assert "mismatch/mantissa_disagree_frac" not in metrics
  if mode == "full":  # full guidance on every layer with replay reproduces nearly every code
    assert metrics["mismatch/code_disagree_frac"] < 0.01
  assert trainer.guided_layers == layers
  # Every arm records the rollout's experts: replay trains with them; the router flip rate
  # compares the training path's routers with them (under replay, their would-be choice).
  assert trainer.engine.config.record_routing
  flips = metrics["mismatch/router_flip_rate"]
  assert 0.0 <= flips <= metrics["mismatch/router_flip_rate_max"] <= 1.0
  if not packs:  # bf16 rollout: router and LM head stay float32, as in the FP4 arms
    state = {
      ".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(trainer.engine.params)
    }
    assert state["lm_head"].dtype == np.float32 and state["blocks.1.moe.router"].dtype == np.float32


@pytest.mark.slow
def test_a_bf16_kv_cache_reaches_both_paths(tmp_path):
  """The KV ablation, `--kv_precision=bf16` on the method's scope: the rollout's cache
  is bf16 and K/V are neither FP4 nor guided on either path (the guidance bytes are the
  experts' alone, from the model's shapes), the experts stay FP4 and guided, and the
  step runs with guidance followed."""
  config = RLConfig.from_flat(
    arm="trace",
    task="arith",
    preset="tiny",
    steps=1,
    prompts_per_step=2,
    group_size=4,
    max_new_tokens=6,
    sft_steps=0,
    eval_every=0,
    eval_size=0,
    checkpoint_every=0,
    fp4_sites="experts+kv",
    kv_precision="bf16",
  )
  assert config.train_quant.kv == "bf16" and not config.train_quant.quantizes("k")
  assert config.train_quant.quantizes("moe_in")
  with Trainer(config, str(tmp_path), progress=False) as trainer:
    rollout_quant = trainer.engine.config.quant
    assert not rollout_quant.quantizes("v") and rollout_quant.quantizes("moe_mid")
    metrics = trainer.train_step()
    cfg = trainer.model_cfg
  _, _, _, _, mode, layers, replay = PROMISES["trace"]
  want = _guidance_bytes_per_token(cfg, layers, mode, "experts+kv", replay, fp4_kv=False)
  assert want < _guidance_bytes_per_token(cfg, layers, mode, "experts+kv", replay)
  assert metrics["guidance/bytes_per_token"] == pytest.approx(want)
  assert np.isfinite(metrics["loss"]) and metrics["guidance/followed_frac"] > 0.5


def test_arm_scope_and_format_reach_the_training_path():
  config = RLConfig.from_flat(arm="trace", fp4_sites="experts+kv", fmt="mxfp4")
  assert (config.train_quant.sites, config.train_quant.fmt) == ("experts+kv", "mxfp4")
  assert config.train_quant.rounding == "guided"
  assert RLConfig.from_flat(arm="fp4-rollout", fmt="mxfp4").train_quant is None


@pytest.mark.slow
@pytest.mark.parametrize(
  "arm, fp4_sites, activations",
  [("trace", "all", "fp4"), ("fp4-qat", "experts+kv", "fp4"), ("trace", "all", "fp8")],
)
def test_one_mxfp4_step_on_a_preset_that_fits(tmp_path, monkeypatch, arm, fp4_sites, activations):
  """--fmt=mxfp4 end to end: MXFP4 rollout weights (E8M0 scales, no global scale), MXFP4 KV
  cache, MXFP4 QAT, guidance captured in the MXFP4 layout; and W4A8 (--activations=fp8:
  linear inputs in MXFP8 E4M3, guidance on the FP4 KV cache only)."""
  config = RLConfig.from_flat(
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
  captured = {}
  _spy_on_the_step(monkeypatch, captured)
  metrics = trainer.train_step()
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["mismatch/k3_kl"])
  rollout, scored = captured["collected"].rollout, captured["scored"]
  by_hand = _disagreement_by_hand(rollout.guidance.sites, scored.train_sites, rollout.mask)
  assert sorted(by_hand) == list(range(trainer.model_cfg.num_layers))
  for layer, row in by_hand.items():
    assert metrics[f"mismatch/scale_disagree/layer_{layer}"] == pytest.approx(row["scale"])
    assert metrics[f"mismatch/mantissa_disagree/layer_{layer}"] == pytest.approx(row["mantissa"])
    if layer in trainer.guided_layers:  # guided: the rollout's E8M0 scales, bit for bit
      assert row["scale"] == 0
  if arm == "trace":
    assert metrics["guidance/bytes_per_token"] > 0
  assert trainer.engine.config.quant.activations == activations
  if activations == "fp8":  # guidance holds the K/V sites only
    captured = trainer.engine.generate([[5, 6, 7]], jax.random.key(0)).guidance
    assert {site for _, site in captured.sites} == {"k", "v"}


def test_mxfp4_on_a_preset_too_narrow_names_the_field_and_presets_that_fit():
  # checked on the architecture the run uses, before any work (`policy_source.preflight`)
  with pytest.raises(ValueError, match=r"fmt='mxfp4'.*preset='tiny' has head_dim=16.*'small'"):
    preflight(RLConfig.from_flat(preset="tiny", fmt="mxfp4"))
  with pytest.raises(ValueError, match=r"preset='qwen3_5_tiny' has head_dim=16"):
    preflight(RLConfig.from_flat(preset="qwen3_5_tiny", fmt="mxfp4", fp4_sites="experts+kv"))
  preflight(RLConfig.from_flat(preset="tiny", fmt="nvfp4"))  # 16-element NVFP4 blocks fit
