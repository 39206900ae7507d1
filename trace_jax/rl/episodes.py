"""Play a batch of task items with a rollout engine: one turn, or a multi-turn episode whose
observations are appended to the same growing sequences (and KV cache)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from trace_jax.rl import data
from trace_jax.rollout.config import RolloutConfig, SamplingConfig
from trace_jax.rollout.engine import FINISH_STOP, Rollout, RolloutEngine
from trace_jax.tasks.base import Item, Task
from trace_jax.tasks.tokenizer import Tokenizer
from trace_jax.utils import round_up
from trace_jax.utils.distributed import host_array


@dataclasses.dataclass
class Episodes:
  """A played batch: the rollout (all turns), each sequence's reward and action texts."""

  rollout: Rollout
  rewards: np.ndarray  # float32 [B]
  actions: list[list[str]]  # per sequence, the text of each turn's action
  turns: np.ndarray  # int32 [B], actions taken


def max_len_for(
  task: Task, prompt_len: int, max_new_tokens: int, bucket: int, observation_len: int = 8
) -> int:
  """Cache slots an episode can need: the padded prompt, then per turn the action and
  the padded observation (`observation_len` tokens at most: more with a chat template)."""
  rounded = lambda n: round_up(n, bucket)
  per_turn = max_new_tokens + (rounded(observation_len) if task.multi_turn else 0)
  return rounded(prompt_len) + task.max_turns * per_turn


def episode_len(config, task: Task, tokenizer: Tokenizer, observation_len: int) -> tuple[int, int]:
  """(cache slots, prompt bucket) of an RL run's episodes: `max_len_for` the task's longest
  prompt among its `Task.prompt_probe` problems (by default its first 64)."""
  prompt_len = max(len(data.prompt_ids(tokenizer, item)) for item in task.prompt_probe())
  bucket = config.sampling.prompt_bucket or (8 if task.multi_turn else 16)
  max_len = max_len_for(
    task, prompt_len, config.sampling.max_new_tokens, bucket, observation_len=observation_len
  )
  return max_len, bucket


def rollout_configs(config, task: Task, source) -> tuple[RolloutConfig, RolloutConfig]:
  """(sampling, greedy) RolloutConfigs of an RL run (`RLConfig`, and its `PolicySource`)
  before the arm's settings (`Arm.rollout`): cache slots for the task's longest episode,
  the run's FP4 scheme. Every engine of the run (and its export's calibration) shares them."""
  tokenizer, stop_tokens = source.tokenizer, source.stop_tokens
  max_len, bucket = episode_len(config, task, tokenizer, source.observation_len)
  new = config.sampling.max_new_tokens
  base = RolloutConfig(
    max_len=max_len,
    prompt_bucket=bucket,
    prefill_chunk=config.sampling.prefill_chunk,
    slots=config.sampling.rollout_slots or None,
    sampling=SamplingConfig(
      temperature=config.sampling.temperature, max_new_tokens=new, stop_tokens=stop_tokens
    ),
    compute_dtype=config.compute_dtype,
    pad_id=tokenizer.pad_id,
    fp4=config.fp4,
    sparse=config.sparse_spec,
  )
  greedy = base.replace(
    sampling=SamplingConfig(greedy=True, max_new_tokens=new, stop_tokens=stop_tokens),
    guidance="none",
    record_routing=False,
  )
  return base, greedy


def evaluate(
  engines: dict[str, RolloutEngine], task: Task, tokenizer: Tokenizer, items: Sequence[Item]
) -> dict[str, float]:
  """Greedy reward on fixed problems per engine: {"eval/reward_<name>": mean reward,
  "eval/reward_<name>_se": its standard error (sample std / sqrt(n)), "eval/problems": n}.

  The standard error treats the problems as a sample of the task's problems: with the
  whole held-out split it is the spread a fresh split of the same size would show.
  """
  out = {"eval/problems": len(items)}
  for name, engine in engines.items():
    rewards = finite_rewards(play(engine, task, tokenizer, items, jax.random.key(0)))
    out[f"eval/reward_{name}"] = float(np.mean(rewards))
    out[f"eval/reward_{name}_se"] = standard_error(rewards)
  return out


def finite_rewards(played: Episodes) -> np.ndarray:
  """Each sequence's reward, NaN where the log-probability of a generated token is not
  finite: there the logits were (NaN or +Inf, e.g. from non-finite weights), and the
  greedy token, whatever it scores, says nothing of the policy; a reward of 0 would read as
  a policy that answered wrong."""
  logprobs = host_array(played.rollout.logprobs)  # [B, S]
  generated = host_array(played.rollout.response_mask)
  broken = ~np.isfinite(np.where(generated, logprobs, 0.0)).all(axis=-1)
  rewards = np.array(played.rewards)
  rewards[broken] = np.nan
  return rewards


def standard_error(values) -> float:
  """Sample standard deviation (n - 1) over sqrt(n); NaN for fewer than two values."""
  values = np.asarray(values, np.float64)
  if values.size < 2:
    return float("nan")
  return float(np.std(values, ddof=1) / np.sqrt(values.size))


def play(
  engine: RolloutEngine,
  task: Task,
  tokenizer: Tokenizer,
  items: Sequence[Item],
  key: jax.Array,
  *,
  version: int = 0,
  sequences: Sequence[int] | None = None,
) -> Episodes:
  """Roll out `items` (one sequence each) to the end of their episodes and score them.
  `version` and `sequences`: the skew's counters (`RolloutEngine.generate`), every turn."""
  prompts = [data.prompt_ids(tokenizer, item) for item in items]
  ids = dict(version=version, sequences=sequences)
  rollout = engine.generate(prompts, jax.random.fold_in(key, 0), **ids)
  n = len(items)
  if not task.multi_turn:
    texts = data.decode_responses(tokenizer, rollout.responses())
    rewards = np.asarray([task.score(item, text) for item, text in zip(items, texts)], np.float32)
    return Episodes(rollout, rewards, [[t] for t in texts], np.ones(n, np.int32))

  states = [task.reset(item) for item in items]
  rewards = np.zeros(n, np.float32)
  done = np.zeros(n, bool)
  actions = [[] for _ in range(n)]
  seen = np.zeros_like(host_array(rollout.response_mask))
  for turn in range(task.max_turns):
    response = host_array(rollout.response_mask)
    tokens = host_array(rollout.tokens)
    finish = host_array(rollout.finish)  # this turn's: stopped by a stop token, or by length
    new = response & ~seen
    seen = response
    observations = []
    for i in range(n):
      if done[i]:
        observations.append([])
        continue
      text = tokenizer.decode(tokens[i][new[i]])
      actions[i].append(text)
      states[i], step = task.step(states[i], text)
      if step.done:
        done[i], rewards[i] = True, step.reward
        observations.append([])
      else:
        observations.append(
          data.observation_ids(
            tokenizer, step.observation, turn_closed=bool(finish[i] == FINISH_STOP)
          )
        )
    if done.all() or turn == task.max_turns - 1:
      break
    rollout = engine.continue_(rollout, observations, jax.random.fold_in(key, turn + 1), **ids)
  turns = np.asarray([len(a) for a in actions], np.int32)
  return Episodes(rollout, rewards, actions, turns)
