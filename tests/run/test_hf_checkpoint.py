"""RL from a local Hugging Face checkpoint directory (trace_jax/run/policy_source.py): the tiny
HF fixtures of every architecture, with a procedural tokenizer and a ChatML template written
into a copy of each. One representative case runs by default; every architecture x arm, the
multi-turn task and the forced warm start are slow:
`pytest -m slow tests/rl/test_hf_checkpoint.py` (many minutes on 2 cores)."""

import importlib.util
import json
import os
import shutil

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.model.hf import from_hf
from trace_jax.rl import data, episodes
from trace_jax.rl.arms import RUNNABLE
from trace_jax.rl.config import RLConfig
from trace_jax.run import policy_source
from trace_jax.run.trainer import Trainer
from trace_jax.tasks.chat import CheckpointTokenizer

HF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
_spec = importlib.util.spec_from_file_location(
  "make_tokenizer", os.path.join(HF, "make_tokenizer.py")
)
make_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tokenizer)

VOCAB = {"qwen3_moe": 96, "mixtral": 96, "olmoe": 96, "qwen3_5_moe": 64, "qwen3_5_moe_text": 64}
SYSTEM = "answer after #."
TINY = dict(
  task="arith",
  steps=2,
  prompts_per_step=2,
  group_size=2,
  minibatches=1,
  max_new_tokens=4,
  eval_every=0,
  eval_size=0,
  checkpoint_every=0,
)


def checkpoint(root, arch: str, vocab_size: int | None = None, **write_options) -> str:
  """A copy of the tiny `arch` fixture (weights, config) with a tokenizer written into it."""
  path = os.path.join(str(root), arch)
  shutil.copytree(
    os.path.join(HF, arch), path, ignore=shutil.ignore_patterns("expected.npz", "tokenizer*")
  )
  make_tokenizer.write(path, vocab_size or VOCAB[arch], **write_options)
  return path


def _chatml(prompt: str) -> str:
  """The ChatML prompt, written out by hand."""
  return (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
    "<|im_start|>assistant\n"
  )


def _params(policy):
  return nnx.to_pure_dict(nnx.state(policy, nnx.Param))


def _run_two_steps(tmp_path, arch, arm, **overrides):
  path = checkpoint(tmp_path, arch)
  config = RLConfig.from_flat(
    arm=arm, hf_checkpoint=path, system_prompt=SYSTEM, **{**TINY, **overrides}
  )
  trainer = Trainer(config, str(tmp_path / "run"), progress=False)
  tok = trainer.tokenizer
  assert isinstance(tok, CheckpointTokenizer)
  # vocabulary and stop tokens from the checkpoint, never from a preset
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  assert trainer.model_cfg.vocab_size == hf.get("text_config", hf)["vocab_size"] == VOCAB[arch]
  assert trainer.engine.config.sampling.stop_tokens == tok.stop_ids
  assert all(e.config.sampling.stop_tokens == tok.stop_ids for e in trainer.eval_engines.values())
  assert trainer.engine.config.pad_id == tok.pad_id
  # prompts: the model's own template, as written out by hand
  items = trainer.task.sample(3, 2)
  assert [data.prompt_ids(tok, i) for i in items] == [tok.encode(_chatml(i.prompt)) for i in items]
  # no warm start by default: the policy (and the KL reference) are the checkpoint's weights
  assert trainer.warmstart["skipped"] and not os.path.exists(tmp_path / "run" / "warmstart")
  loaded = _params(from_hf(path))
  chex.assert_trees_all_equal(_params(trainer.policy), loaded)

  history = trainer.run()
  assert [m["step"] for m in history] == [1, 2]
  for m in history:
    assert np.isfinite(m["loss"]) and np.isfinite(m["mismatch/k3_kl"])
    assert (
      0 <= m["rewards/mean"] <= 1 and 1 <= m["completions/mean_length"] <= TINY["max_new_tokens"]
    )
  if trainer.reference is not None:
    chex.assert_trees_all_equal(_params(trainer.reference), loaded)
  moved = jax.tree.leaves(
    jax.tree.map(
      lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), _params(trainer.policy), loaded
    )
  )
  assert max(moved) > 0  # two updates changed the weights
  return trainer, history


def test_two_rl_steps_from_a_checkpoint(tmp_path):
  """Representative: Qwen3-MoE, the cheapest arm (bf16), a KL reference (which must stay the
  checkpoint's weights while the policy moves)."""
  _run_two_steps(tmp_path, "qwen3_moe", "bf16", kl_coef=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("arm", sorted(RUNNABLE))
@pytest.mark.parametrize("arch", sorted(VOCAB))
def test_two_rl_steps_every_architecture_and_arm(tmp_path, arch, arm):
  # The Qwen3.5 text fixture's 24-wide shared expert does not split into 16-element blocks:
  # it runs in the method's FP4 scope (experts and KV cache), as `check` tells such a user.
  sites = "experts+kv" if arch == "qwen3_5_moe_text" else "all"
  trainer, history = _run_two_steps(tmp_path, arch, arm, eval_every=2, eval_size=2, fp4_sites=sites)
  assert {"eval/reward_fp4", "eval/reward_bf16"} <= set(history[-1])


@pytest.mark.slow
def test_multi_turn_observations_go_in_as_template_turns(tmp_path):
  path = checkpoint(tmp_path, "qwen3_moe")
  config = RLConfig.from_flat(
    arm="trace",
    hf_checkpoint=path,
    observation_role="tool",
    **{
      **TINY,
      "task": "search",
      "task_options": (("bits", 2), ("max_turns", 3)),
      "max_new_tokens": 3,
    },
  )
  trainer = Trainer(config, str(tmp_path / "run"), progress=False)
  tok = trainer.tokenizer
  played = episodes.play(
    trainer.engine, trainer.task, tok, trainer.task.sample(0, 4), jax.random.key(0)
  )
  tokens, response = np.asarray(played.rollout.tokens), np.asarray(played.rollout.response_mask)
  mask = np.asarray(played.rollout.mask)
  assert played.turns.max() >= 2  # an untrained policy rarely guesses right at once
  for row in range(4):
    if played.turns[row] < 2:
      continue
    # the environment tokens after the first action are the template's tool turn
    env = [int(t) for t, m, r in zip(tokens[row], mask[row], response[row]) if m and not r]
    text = tok._hf._tok.decode(env, skip_special_tokens=False)
    assert "<|im_start|>user\n<tool_response>\n" in text and text.endswith(
      "<|im_start|>assistant\n"
    )
  history = trainer.run()
  assert np.isfinite(history[-1]["loss"])


@pytest.mark.slow
def test_forced_warm_start_uses_the_checkpoint_tokenizer(tmp_path):
  path = checkpoint(tmp_path, "qwen3_moe")
  config = RLConfig.from_flat(
    arm="bf16", hf_checkpoint=path, sft_warm_start=True, sft_steps=2, sft_batch=4, **TINY
  )
  trainer = Trainer(config, str(tmp_path / "run"), progress=False)
  assert trainer.warmstart["steps"] == 2 and not trainer.warmstart.get("skipped")
  assert np.isfinite(trainer.warmstart["final_nll"])


def test_errors_before_any_work(tmp_path):
  # The checkpoint directory's files: checked by the policy source before any work (the
  # config's validation reads no file).
  with pytest.raises(ValueError, match="is not a directory"):
    policy_source.preflight(RLConfig.from_flat(hf_checkpoint=str(tmp_path / "nowhere")))
  bare = tmp_path / "bare"
  shutil.copytree(os.path.join(HF, "olmoe"), bare, ignore=shutil.ignore_patterns("expected.npz"))
  with pytest.raises(ValueError, match="lacks tokenizer.json"):
    policy_source.preflight(RLConfig.from_flat(hf_checkpoint=str(bare)))
  with pytest.raises(ValueError, match="lacks tokenizer.json"):
    Trainer(RLConfig.from_flat(hf_checkpoint=str(bare)), str(tmp_path / "never"), progress=False)
  assert not os.path.exists(tmp_path / "never")  # refused before the workdir is made
  with pytest.raises(ValueError, match="prompt_format='chat' needs hf_checkpoint"):
    RLConfig.from_flat(prompt_format="chat")
  with pytest.raises(ValueError, match="system_prompt=.*needs a chat template"):
    RLConfig.from_flat(system_prompt="be brief")
  with pytest.raises(ValueError, match="prompt_format="):
    RLConfig.from_flat(prompt_format="jinja")

  def refused(config, match):
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
      Trainer(config, str(workdir), progress=False)
    assert not os.path.exists(workdir / "warmstart") and not os.path.exists(
      workdir / "metrics.jsonl"
    )

  # a tokenizer larger than the checkpoint's embedding (96 ids, 64 rows)
  # (in the FP4 scope its 24-wide shared expert fits: the widths are checked first)
  big = checkpoint(tmp_path / "big", "qwen3_5_moe_text", vocab_size=96)
  refused(
    RLConfig.from_flat(hf_checkpoint=big, fp4_sites="experts+kv", **TINY),
    "tokenizer.json has ids up to 95 but the checkpoint's embedding has 64 rows",
  )
  # widths FP4 blocks cannot split (the 24-wide shared expert under fp4_sites="all")
  refused(
    RLConfig.from_flat(hf_checkpoint=checkpoint(tmp_path / "wide", "qwen3_5_moe_text"), **TINY),
    "shared_expert_dim=24 .* not a multiple of 16; RLConfig.fp4_sites='experts\\+kv'",
  )
  # no chat template, when one is needed (the default prompt format of a checkpoint)
  base = checkpoint(tmp_path / "base", "olmoe", chat_template=None)
  refused(RLConfig.from_flat(hf_checkpoint=base, **TINY), "no chat template.*--prompt_format=raw")
  # a template that refuses the observation role of a multi-turn task
  strict = make_tokenizer.CHAT_TEMPLATE.replace("message.role == 'tool'", "false")
  picky = checkpoint(tmp_path / "picky", "olmoe", chat_template=strict)
  refused(
    RLConfig.from_flat(hf_checkpoint=picky, observation_role="tool", **{**TINY, "task": "search"}),
    "refused the conversation: unknown role tool",
  )


def test_a_failing_template_is_refused_before_the_workdir_is_made(tmp_path):
  # The first prompt renders before the workdir (and its lock) exists; the error names the
  # template's file.
  broken = checkpoint(tmp_path / "broken", "olmoe", chat_template="{{ messages | length / 0 }}")
  workdir = tmp_path / "run"
  with pytest.raises(ValueError) as raised:
    Trainer(RLConfig.from_flat(hf_checkpoint=broken, **TINY), str(workdir), progress=False)
  assert str(raised.value) == (
    f"{broken}/tokenizer_config.json: the chat template failed to render "
    "(ZeroDivisionError: division by zero)"
  )
  assert not os.path.exists(workdir)


def test_block_fit_is_checked_on_the_widths_the_run_uses(tmp_path):
  """With hf_checkpoint the checkpoint's widths are checked against the FP4 blocks, not the
  (ignored) preset's: a checkpoint whose widths split into MXFP4's 32-element blocks runs
  with preset 'tiny' (16-wide heads), and a 16-wide checkpoint is refused, before any work,
  by its own widths whichever preset is named."""
  wide = checkpoint(tmp_path / "fits", "qwen3_moe")  # its config.json widths doubled
  with open(os.path.join(wide, "config.json")) as f:
    hf = json.load(f)
  hf.update(hidden_size=64, head_dim=32, moe_intermediate_size=32, intermediate_size=64)
  with open(os.path.join(wide, "config.json"), "w") as f:
    json.dump(hf, f)
  config = RLConfig.from_flat(hf_checkpoint=wide, preset="tiny", fmt="mxfp4", **TINY)
  policy_source.preflight(config)
  assert policy_source.architecture(config).quantized_widths() == {
    "d_model": 64, "moe_ffn_dim": 32, "head_dim": 32, "ffn_dim": 64
  }  # fmt: skip
  narrow = checkpoint(tmp_path / "narrow", "qwen3_moe")  # 16-wide heads and experts
  for preset in ("tiny", "small"):  # 'small' fits MXFP4: the preset is not what runs
    config = RLConfig.from_flat(hf_checkpoint=narrow, preset=preset, fmt="mxfp4", **TINY)
    with pytest.raises(
      ValueError,
      match=r"fmt='mxfp4' quantizes in blocks of 32, but hf_checkpoint=.*narrow.* has "
      r"moe_ffn_dim=16, head_dim=16, ffn_dim=48 .*; fmt='nvfp4' fits it$",
    ):
      policy_source.preflight(config)
  # a preset's own widths: refused before any work, with the presets that fit
  with pytest.raises(ValueError, match=r"preset='tiny' has head_dim=16 .*fit: \[.*'small'"):
    policy_source.preflight(RLConfig.from_flat(preset="tiny", fmt="mxfp4", **TINY))


def test_a_checkpoint_saved_before_the_new_fields_still_resumes():
  config = RLConfig()
  new_fields = (
    "hf_checkpoint",
    "sft_warm_start",
    "prompt_format",
    "system_prompt",
    "observation_role",
    "chat_template_options",
  )
  saved = {k: v for k, v in RLConfig.flat_dict(config.to_dict()).items() if k not in new_fields}
  assert config.differences(saved) == []
  changed = RLConfig.from_flat(system_prompt="", prompt_format="raw")
  assert changed.differences(saved) == ["prompt_format"]


@pytest.mark.parametrize("remat", [False, True])
def test_load_configures_the_policy(tmp_path, remat):
  """policy_source.load takes the run config and returns the policy configured for it
  (ModelConfig.remat), from a preset and from a checkpoint alike; the weights are the
  checkpoint's either way."""
  from trace_jax.tasks.registry import get_task

  task = get_task("arith")
  preset = policy_source.load(RLConfig.from_flat(preset="tiny", remat=remat, **TINY), task)
  assert preset.policy.cfg.remat is remat and preset.model_cfg == preset.policy.cfg
  path = checkpoint(tmp_path, "qwen3_moe")
  source = policy_source.load(RLConfig.from_flat(hf_checkpoint=path, remat=remat, **TINY), task)
  assert source.policy.cfg.remat is remat and source.model_cfg == source.policy.cfg
  chex.assert_trees_all_equal(_params(source.policy), _params(from_hf(path)))


def test_a_checkpoint_is_read_through_one_call_that_takes_the_learners_mesh(tmp_path, monkeypatch):
  """policy_source.load reads a checkpoint through `load_hf_policy`: with the learner's mesh
  `from_hf` gets it (every parameter built in its sharding), without one it is called as
  before (one device; the trainer places the policy)."""
  from trace_jax.model.sharding import make_mesh
  from trace_jax.tasks.registry import get_task

  calls = []

  def spy(path, **kwargs):
    calls.append((path, kwargs))
    return from_hf(path, **{k: v for k, v in kwargs.items() if k != "mesh"})

  monkeypatch.setattr(policy_source, "from_hf", spy)
  path = checkpoint(tmp_path, "qwen3_moe")
  config = RLConfig.from_flat(hf_checkpoint=path, **TINY)
  mesh = make_mesh(1, 1, 1)
  for given in (None, mesh):
    source = policy_source.load(config, get_task("arith"), mesh=given)
    assert source.model_cfg == source.policy.cfg
  assert calls[0] == (path, policy_source.runtime_fields(config))
  assert calls[1] == (path, {**policy_source.runtime_fields(config), "mesh": mesh})
