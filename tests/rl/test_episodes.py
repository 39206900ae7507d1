"""The evaluation of a policy whose logits are not finite is NaN, never a reward of 0; and a
step that fails on weights already non-finite does not blame the learning rate."""

import types

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.model.config import tiny
from trace_jax.model.transformer import Transformer
from trace_jax.rl import episodes
from trace_jax.rl.config import RLConfig
from trace_jax.rl.step import DivergenceError, Update, check_update
from trace_jax.rollout.config import RolloutConfig, SamplingConfig
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.tasks import CharTokenizer, get_task


@pytest.fixture(scope="module")
def setup():
  task, tokenizer = get_task("arith"), CharTokenizer()
  policy = Transformer(tiny(vocab_size=max(128, tokenizer.vocab_size)), rngs=nnx.Rngs(3))
  config = RolloutConfig(
    precision="bf16",
    guidance="none",
    record_routing=False,
    max_len=64,
    pad_id=tokenizer.pad_id,
    sampling=SamplingConfig(greedy=True, max_new_tokens=3, stop_tokens=(tokenizer.eos_id,)),
  )
  return task, tokenizer, policy, config, task.sample(5, 4, split="eval")


def test_rewards_of_sequences_with_non_finite_log_probabilities_are_nan():
  rng = np.random.default_rng(0)
  logprobs = -rng.random((3, 6)).astype(np.float32)
  generated = np.zeros((3, 6), bool)
  generated[:, 3:] = True
  logprobs[0, 1] = np.nan  # a prompt slot: not a generated token's
  logprobs[1, 4] = np.nan
  logprobs[2, 5] = np.inf
  rewards = rng.random(3).astype(np.float32)
  rollout = types.SimpleNamespace(logprobs=logprobs, response_mask=generated)
  played = episodes.Episodes(rollout, rewards, [["a"]] * 3, np.ones(3, np.int32))
  out = episodes.finite_rewards(played)
  assert out.dtype == np.float32 and out[0] == rewards[0] and np.isnan(out[1:]).all()
  assert not np.isnan(rewards).any()  # the played rewards are left as they were


@pytest.mark.slow
def test_an_evaluation_with_non_finite_logits_is_nan_and_a_finite_one_unchanged(setup):
  task, tokenizer, policy, config, items = setup
  engine = RolloutEngine(policy, config)
  result = episodes.evaluate({"bf16": engine}, task, tokenizer, items)
  played = episodes.play(engine, task, tokenizer, items, jax.random.key(0))
  assert result["eval/reward_bf16"] == float(np.mean(played.rewards))
  assert result["eval/reward_bf16_se"] == episodes.standard_error(played.rewards)

  poisoned = nnx.clone(policy)
  column = int(np.random.default_rng(1).integers(0, poisoned.lm_head.get_value().shape[1]))
  poisoned.lm_head.set_value(poisoned.lm_head.get_value().at[:, column].set(np.nan))
  result = episodes.evaluate({"bf16": RolloutEngine(poisoned, config)}, task, tokenizer, items)
  assert np.isnan(result["eval/reward_bf16"]) and np.isnan(result["eval/reward_bf16_se"])


def test_a_failed_step_on_non_finite_weights_does_not_blame_the_learning_rate(setup):
  policy = setup[2]
  spec = types.SimpleNamespace(config=RLConfig.from_flat(learning_rate=3e-5))
  nan = float("nan")
  done = Update((nan,), ({},), (nan,), False, nan, None)
  with pytest.raises(DivergenceError, match=r"Lower --learning_rate \(now 3e-05\)"):
    check_update(spec, 4, done, "resume from step 3", before=policy)
  broken = nnx.clone(policy)
  broken.embed.set_value(broken.embed.get_value().at[2, 1].set(np.inf))
  with pytest.raises(DivergenceError) as error:
    check_update(spec, 4, done, "resume from step 3", before=broken)
  message = str(error.value)
  assert "the learning rate is not the cause" in message and "Lower" not in message
  assert message.startswith("step 4 failed: the loss is [nan]; the gradient norm is [nan]")


def test_a_non_finite_initial_evaluation_is_reported(caplog):
  from trace_jax.run.trainer import _warn_if_non_finite

  _warn_if_non_finite({"eval/reward_fp4": 0.25, "eval/reward_fp4_se": float("nan")})
  assert not caplog.records  # one problem has no standard error: not a fault
  _warn_if_non_finite({"eval/reward_fp4": float("nan"), "eval/reward_bf16": 0.5})
  assert "initial evaluation is non-finite (eval/reward_fp4=nan, eval/reward_bf16=0.5)" in (
    caplog.text
  )
