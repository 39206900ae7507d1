"""What each stage of a run is given, on the task with held-out problems (`chain`: a
quarter of the 1,296 four-term sums held out by the CRC-32 of the prompt): the SFT warm
start's demonstrations and the RL steps' problems come from split "train", the evaluation's
problems from "eval", and none is both. The task-level split is tested in tests/tasks; this
checks that the trainer asks for the right one at each stage. Spies stand in for SFT
training and rollouts, so nothing trains and nothing rolls out."""

import re
import zlib

import numpy as np
import pytest

from trace_jax.rl import episodes as episodes_lib
from trace_jax.run import warmstart
from trace_jax.rl.config import RLConfig
from trace_jax.run.trainer import Trainer

_SUM = re.compile(r"^(\d)\+(\d)\+(\d)\+(\d)=$")


def _held_out(prompt: str) -> bool:
  """The chain task's held-out quarter, from its definition: CRC-32 of the prompt text
  below a quarter of 2^32."""
  return zlib.crc32(prompt.encode()) < 2**30


class _Stop(Exception):
  """Raised by the rollout spy: the stage's problems are seen, nothing rolls out."""


def test_sft_and_rl_steps_draw_train_problems_and_the_evaluation_held_out_ones(
  tmp_path, monkeypatch
):
  sft_batches = []

  def sft_spy(policy, batches, *, steps, **kwargs):  # what SFT would train on, untrained
    sft_batches.extend(tuple(np.asarray(a) for a in batches(step)) for step in range(steps))
    return [1.0] * steps

  played = []

  def rollout_spy(engine, task, tokenizer, items, key, **counters):  # counters: the skew's
    played.append([item.prompt for item in items])
    raise _Stop

  monkeypatch.setattr(warmstart, "train_sft", sft_spy)
  monkeypatch.setattr(episodes_lib, "play", rollout_spy)
  config = RLConfig.from_flat(
    task="chain",
    preset="tiny",
    arm="bf16",
    steps=3,
    prompts_per_step=32,
    group_size=2,
    sft_steps=3,
    sft_batch=32,
    eval_size=64,
    eval_every=1,
    checkpoint_every=0,
  )
  trainer = Trainer(config, str(tmp_path), progress=False)

  # SFT: the prompt part of every demonstration row (valid, not trained on), and the
  # completion it is taught: the sum worked out to its answer.
  assert len(sft_batches) == config.source.sft_steps
  sft_prompts = []
  for tokens, loss_mask, valid in sft_batches:
    assert tokens.shape[0] == config.source.sft_batch
    for row, trained, real in zip(tokens, loss_mask, valid):
      prompt = trainer.tokenizer.decode(row[real & ~trained])
      completion = trainer.tokenizer.decode(row[trained])
      operands = _SUM.match(prompt)
      assert operands, prompt
      assert completion.endswith(f"#{sum(int(x) for x in operands.groups())}"), completion
      sft_prompts.append(prompt)

  # RL: the problems of three steps, as the rollout receives them.
  rl_prompts = []
  for step in range(3):
    trainer.state = trainer.state.replace(step=step)  # the step whose problems are drawn
    with pytest.raises(_Stop):
      trainer.train_step()
    assert len(played[-1]) == config.batch
    rl_prompts += played[-1]

  # Evaluation: what `evaluate` hands the rollout (one engine stands in for the FP4 and
  # bf16 evaluation engines: their weights play no part in which problems are drawn).
  trainer.__dict__["eval_engines"] = {"bf16": trainer._engine}
  with pytest.raises(_Stop):
    trainer.evaluate()
  eval_prompts = played[-1]
  assert len(eval_prompts) == config.evaluation.eval_size

  for name, prompts in (("sft", sft_prompts), ("rl", rl_prompts), ("eval", eval_prompts)):
    assert all(_SUM.match(p) for p in prompts), name
    held_out = [p for p in prompts if _held_out(p)]
    if name == "eval":
      assert held_out == prompts, name
    else:
      assert not held_out, (name, held_out[:5])
  assert not set(eval_prompts) & (set(sft_prompts) | set(rl_prompts))
  # Many different problems at each stage (not one problem repeated).
  assert min(len(set(sft_prompts)), len(set(rl_prompts)), len(set(eval_prompts))) >= 30
