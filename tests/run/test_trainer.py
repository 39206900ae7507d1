"""The RL trainer end to end: each task kind, exact resume, bad input, a device mesh."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.run import report
from trace_jax.rl.config import RLConfig
from trace_jax.rl import optimizer as optimizer_lib
from trace_jax.rl import step as step_lib
from trace_jax.run.rundir import read_metrics
from trace_jax.run.trainer import Trainer
from trace_jax.rl.metrics import TIMING_METRICS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMING = TIMING_METRICS


def _config(**overrides):
  base = dict(
    task="arith",
    preset="tiny",
    steps=1,
    prompts_per_step=2,
    group_size=4,
    minibatches=2,
    max_new_tokens=8,
    sft_steps=3,
    sft_batch=8,
    eval_size=4,
    eval_every=1,
    checkpoint_every=1,
  )
  return RLConfig.from_flat(**{**base, **overrides})


# coding and search take 2-3 min each on 2 cores: `pytest -m slow tests/rl/test_trainer.py`.
@pytest.mark.parametrize(
  "task, options",
  [
    ("arith", ()),
    pytest.param("coding", (), marks=pytest.mark.slow),
    pytest.param("search", (("bits", 3), ("max_turns", 5)), marks=pytest.mark.slow),
  ],
)
def test_short_run_on_each_task_kind(tmp_path, task, options):
  """One step (the resume test runs several), with an evaluation before and after it.
  arith and coding share one prompt width, so the second reuses the first's compilations;
  only arith warm-starts (SFT), the others start from the random policy."""
  # coding also trains against a KL reference policy (a copy: the policy's buffers are donated).
  # One update per step (the main job's): the fused update, pi_old's forward its own.
  config = _config(
    task=task,
    task_options=options,
    max_new_tokens=4 if task == "search" else 8,
    prompt_bucket=8 if task == "search" else 32,
    sft_steps=3 if task == "arith" else 0,
    kl_coef=0.01 if task == "coding" else 0.0,
    minibatches=1,
  )
  trainer = Trainer(config, str(tmp_path), progress=False)
  assert trainer.spec.fused  # one minibatch: the fused update, whose forward gives pi_old
  # The buffers the step's update receives: nothing before it (the step-0 evaluation, the
  # rollout, the reference's forward) touches the policy's or the optimizer's arrays.
  given = jax.tree.leaves((nnx.state(trainer.policy, nnx.Param), nnx.state(trainer.state.opt)))
  reference = None if trainer.reference is None else jax.tree.leaves(nnx.state(trainer.reference))
  history = trainer.run()
  # The update donated the policy's and the optimizer's buffers (updated in place)...
  assert given and all(x.is_deleted() for x in given)
  # ...and the KL reference, a copy of its own, is intact.
  assert (reference is not None) == (task == "coding")
  assert reference is None or not any(x.is_deleted() for x in reference)
  assert [m["step"] for m in history] == [1]
  for m in history:
    for key in (
      "rewards/mean",
      "mismatch/k3_kl",
      "mismatch/kl",
      "is_ratio/mean",
      "tis/clip_frac",
      "pg_clipfrac",
      "entropy",
      "completions/mean_length",
      "guidance/bytes_per_token",
      "guidance/followed_frac",
      "mismatch/mantissa_disagree_frac",
      "mismatch/scale_disagree_frac",
      "mismatch/mantissa_disagree/layer_0",
      "rollout/slot_utilization",
      "rollout/tokens_per_second",
      "rollout/prefill_shared_frac",
    ):
      assert key in m and np.isfinite(m[key]), key
    assert 0 < m["rollout/slot_utilization"] <= 1 and m["rollout/prefill_shared_frac"] == 0
  assert history[-1]["guidance/bytes_per_token"] > 0  # the trace arm captures guidance
  if task == "search":
    assert max(m["episodes/mean_turns"] for m in history) > 1
  metrics = read_metrics(str(tmp_path))
  assert "eval/reward_fp4" in metrics[0] and "eval/reward_bf16" in metrics[-1]
  for m in (metrics[0], metrics[-1]):  # each problem once, with the standard error by hand
    assert m["eval/problems"] == len(trainer.eval_items) == config.evaluation.eval_size
    problems = {(item.prompt, repr(item.target)) for item in trainer.eval_items}
    assert len(problems) == len(trainer.eval_items)
    for precision in ("fp4", "bf16"):
      p, n = m[f"eval/reward_{precision}"], m["eval/problems"]
      # arith's rewards are 0 or 1: the sample variance is p (1 - p) n / (n - 1)
      assert m[f"eval/reward_{precision}_se"] == pytest.approx(
        np.sqrt(p * (1 - p) * n / (n - 1) / n), abs=1e-6
      )
  summary = report.summarize(config, metrics, 1.0, trainer.warmstart)
  for key in (
    "arm",
    "task",
    "steps",
    "initial_eval_reward",
    "final_eval_reward",
    "mean_k3_kl",
    "guidance_bytes_per_token",
    "rollout_seconds",
    "train_seconds",
  ):
    assert summary[key] is not None, key
  # What ran is recorded: on CPU kernels="auto" takes the XLA path, and says why.
  assert all(m["kernels/rollout"] == "xla" for m in history)
  assert summary["kernels"] == "xla" and "not a GPU" in summary["kernels_fallback_reason"]
  for path in report.plot(metrics, str(tmp_path), "test"):
    assert os.path.getsize(path) > 1000


def _params(trainer):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.policy)))


@pytest.mark.parametrize("skew", [0.0, pytest.param(2**-6, marks=pytest.mark.slow)])
def test_resume_continues_exactly(tmp_path, skew):
  # A constant learning rate: a decaying one spans the run's steps, so a run stopped by
  # --steps=1 and extended to 3 took its first updates on another schedule than the straight
  # run (an interrupted run resumed with its own steps continues exactly either way). A
  # skewed run's rollouts hash the saved skew with the restored version and step.
  config = _config(steps=3, eval_every=0, prompt_bucket=32, lr_decay="constant", rollout_skew=skew)
  straight = Trainer(config, str(tmp_path / "straight"), progress=False)
  straight.run()
  first = Trainer(config.replace(steps=1), str(tmp_path / "resumed"), progress=False)
  first.run()
  resumed = Trainer(config, str(tmp_path / "resumed"), progress=False)
  assert resumed.step == 1 and resumed.warmstart["loaded"]
  resumed.run()
  jax.tree.map(np.testing.assert_array_equal, _params(resumed), _params(straight))
  a = read_metrics(str(tmp_path / "straight"))
  b = read_metrics(str(tmp_path / "resumed"))
  assert [m["step"] for m in b] == [1, 2, 3]
  strip = lambda m: {k: v for k, v in m.items() if k not in TIMING}
  assert [strip(m) for m in a] == [strip(m) for m in b]


@pytest.mark.slow
def test_a_skewed_run_skews_its_rollouts_only_by_run_quantities(tmp_path):
  """RLConfig.rollout_skew reaches the arm's rollout engine, not the evaluation's; a step's
  rollout is a function of (seed, step, policy version) as without a skew, the version one
  of the skew's counters; the skew raises the step's k3 against the training path. No
  rollout_skew given is rollout_skew=0: the same config, the same run."""
  config = _config(
    arm="fp4-qat", sft_steps=0, eval_every=0, checkpoint_every=0, minibatches=1, group_size=8
  )
  assert config.replace(rollout_skew=0.0) == config and config.rollout_skew == 0.0
  skew = 2**-4
  trainer = Trainer(config.replace(rollout_skew=skew), str(tmp_path / "skewed"), progress=False)
  assert trainer.engine.config.skew == skew
  assert [e.config.skew for e in trainer.eval_engines.values()] == [0.0, 0.0]
  collect = lambda version: step_lib.collect(  # noqa: E731
    trainer.spec, trainer.engine, trainer.task, trainer.tokenizer, 1, version
  )
  first, again, other = collect(0), collect(0), collect(1)
  np.testing.assert_array_equal(first.rollout.tokens, again.rollout.tokens)
  np.testing.assert_array_equal(first.rollout.logprobs, again.rollout.logprobs)
  assert not np.array_equal(first.rollout.logprobs, other.rollout.logprobs)
  plain = Trainer(config, str(tmp_path / "plain"), progress=False)
  k3 = lambda t: t.train_step()["mismatch/k3_kl"]  # noqa: E731
  assert k3(trainer) > 3 * k3(plain)


def test_resume_with_another_config_names_the_fields(tmp_path):
  Trainer(_config(steps=1, eval_every=0, prompt_bucket=32), str(tmp_path), progress=False).run()
  with pytest.raises(ValueError, match=r"\['group_size', 'learning_rate'\]"):
    Trainer(
      _config(steps=1, eval_every=0, prompt_bucket=32, learning_rate=1e-3, group_size=2),
      str(tmp_path),
      progress=False,
    )


@pytest.mark.parametrize(
  "overrides, match",
  [
    (dict(arm="int8"), "arm='int8'.*trace"),
    (dict(task="chess"), "task='chess'.*arith"),
    (dict(preset="huge"), "preset='huge'.*tiny"),
    (dict(group_size=3, minibatches=2, prompts_per_step=1), "minibatches"),
    (dict(correction="always"), "correction='always'"),
    (dict(fp4_sites="experts"), "fp4_sites='experts'.*experts\\+kv"),
    (dict(fmt="fp8"), "fmt='fp8'.*mxfp4"),
    (dict(lr_warmup_steps=-1), "lr_warmup_steps=-1"),
    (dict(reward_control="random"), "reward_control='random'.*shuffle"),
  ],
)
def test_bad_configs(overrides, match):
  with pytest.raises(ValueError, match=match):
    _config(**overrides)


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match="not writable"):
    Trainer(_config(), str(blocker / "run"), progress=False)


MESH_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from trace_jax.rl.config import RLConfig
    from trace_jax.run.trainer import Trainer
    assert jax.device_count() == 8
    config = RLConfig.from_flat(preset="tiny", steps=1, prompts_per_step=4, group_size=4, minibatches=2, max_new_tokens=4,
                      sft_steps=0, eval_size=8, eval_every=0, checkpoint_every=0,
                      mesh=(8, 1, 1))
    trainer = Trainer(config, sys.argv[1], progress=False)
    history = trainer.run()
    assert all(np.isfinite(m["loss"]) for m in history)
    tokens = trainer.engine.generate([[1, 5, 6]] * 16, jax.random.key(0)).tokens
    assert len(tokens.sharding.device_set) == 8, tokens.sharding
    print("OK", [round(m["rewards/mean"], 3) for m in history])
""")


@pytest.mark.slow  # ~2.5 min; the default suite's tests/model/test_sharding.py covers a mesh
def test_data_parallel_run_on_eight_devices(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run(
    [sys.executable, "-c", MESH_SCRIPT, str(tmp_path)],
    capture_output=True,
    text=True,
    env=env,
    timeout=900,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert "OK" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(2100)  # its run's own limit: 30 min
def test_main_job_script(tmp_path):
  cmd = [
    sys.executable,
    os.path.join(ROOT, "experiments", "rl.py"),
    f"--workdir={tmp_path}",
    "--steps=4",
    "--sft_steps=10",
    "--eval_every=2",
    "--eval_size=8",
    "--prompts_per_step=4",
  ]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["arm"] == "trace" and summary["steps"] == 4
  assert (tmp_path / "reward.png").exists() and (tmp_path / "mismatch.png").exists()


def test_init_state_commits_every_array():
  """jit compiles anew when an input turns from uncommitted to committed, as the first
  update's outputs are: a fresh state (a policy just made, Adam's step counters) holds only
  committed arrays, so the second update and rollout reuse the first's compilations."""
  from trace_jax import model as M

  policy = M.Transformer(M.tiny(), rngs=nnx.Rngs(0))
  arrays = lambda tree: [a for a in jax.tree.leaves(nnx.state(tree)) if isinstance(a, jax.Array)]  # noqa: E731
  assert not all(a.committed for a in arrays(policy))  # made uncommitted: what the test is about
  state = step_lib.init_state(RLConfig.from_flat(preset="tiny"), policy)
  assert all(a.committed for a in arrays(state.policy) + arrays(state.opt))


def test_learning_rate_warmup():
  """Adam's first update moves every parameter by the learning rate times the sign of its
  gradient (m / sqrt(v) = g / |g| after bias correction): lr / 10 at the first warmup update,
  the full lr once the warmup is over."""
  import jax.numpy as jnp

  lr, warmup = 1e-3, 4
  tx = optimizer_lib.optimizer(lr, warmup)
  grads = {"w": jnp.asarray(np.random.default_rng(248).uniform(0.01, 0.1, 5), jnp.float32)}
  state = tx.init(grads)
  sizes = []
  for _ in range(warmup + 2):
    updates, state = tx.update(grads, state)
    sizes.append(float(jnp.max(jnp.abs(updates["w"]))))
  np.testing.assert_allclose(sizes[0], lr / 10, rtol=1e-3)
  np.testing.assert_allclose(sizes[-1], lr, rtol=1e-3)
  assert all(a < b for a, b in zip(sizes[:warmup], sizes[1 : warmup + 1]))


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_learning_rate_decay_by_hand(decay):
  """After a warmup the learning rate falls to lr / 10 at the last update, by the formula:
  a constant gradient makes each Adam update lr(t) times its sign, so the update sizes are
  the schedule."""
  import jax.numpy as jnp

  lr, warmup, total = 1e-3, 3, 12
  tx = optimizer_lib.optimizer(lr, warmup, decay, total)
  grads = {"w": jnp.asarray(np.random.default_rng().uniform(0.01, 0.1, 5), jnp.float32)}
  state = tx.init(grads)
  sizes = []
  for _ in range(total + 2):
    updates, state = tx.update(grads, state)
    sizes.append(float(jnp.max(jnp.abs(updates["w"]))))
  for t, size in enumerate(sizes):
    if t < warmup:
      want = lr / 10 + (lr - lr / 10) * t / warmup
    else:
      frac = min(t - warmup, total - warmup) / (total - warmup)
      fall = 0.5 * (1 + np.cos(np.pi * frac)) if decay == "cosine" else 1 - frac
      want = lr / 10 + (lr - lr / 10) * fall
    np.testing.assert_allclose(size, want, rtol=1e-3, err_msg=f"update {t}")
  assert sizes[-1] == pytest.approx(lr / 10, rel=1e-3)
  with pytest.raises(ValueError, match="lr_decay='step' is not allowed"):
    optimizer_lib.optimizer(lr, 0, "step", total)


def _adam_by_hand(grads, lr, max_grad_norm, b1=0.9, b2=0.999, eps=1e-8):
  """Each update of Adam (optax's defaults) on gradients first clipped to a global norm."""
  m = v = np.zeros_like(grads[0], np.float64)
  out = []
  for t, g in enumerate(grads, 1):
    g = g * min(1.0, max_grad_norm / np.linalg.norm(g))
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    out.append(-lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps))
  return out


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.3, 50.0])
def test_gradient_clipping_follows_max_grad_norm(max_grad_norm):
  """The optimizer clips each gradient to global norm `max_grad_norm` before Adam (checked
  against Adam by hand on gradients of norms above and below it), and `init_state` takes it
  from the config (--max_grad_norm; default 1.0, the clipping runs always had)."""
  import jax.numpy as jnp

  rng = np.random.default_rng(int(max_grad_norm * 10))
  grads = [rng.normal(0, s, 6).astype(np.float32) for s in (4.0, 0.05, 1.0, 0.2)]
  tx = optimizer_lib.optimizer(1e-3, 0, "constant", 0, max_grad_norm)
  state = tx.init({"w": jnp.zeros(6)})
  for g, want in zip(grads, _adam_by_hand(grads, 1e-3, max_grad_norm)):
    updates, state = tx.update({"w": jnp.asarray(g)}, state)
    np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=2e-4, atol=1e-9)
  assert RLConfig().schedule.max_grad_norm == 1.0
  config = RLConfig.from_flat(preset="tiny", steps=3, max_grad_norm=max_grad_norm)
  policy = nnx.Module()
  policy.w = nnx.Param(jnp.ones(3))
  opt = step_lib.init_state(config, policy).opt
  assert opt.tx is optimizer_lib.optimizer(
    config.schedule.learning_rate, 0, config.schedule.lr_decay, 3, max_grad_norm
  )
  for bad in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match=rf"RLConfig.max_grad_norm={bad!r} must be a finite"):
      RLConfig.from_flat(max_grad_norm=bad)
    with pytest.raises(ValueError, match=rf"max_grad_norm={bad!r} must be a finite"):
      optimizer_lib.optimizer(1e-3, max_grad_norm=bad)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_a_decay_with_no_update_after_the_warmup_is_refused(decay):
  """A decay over no updates used to give the warmup alone (the decay dropped, silently): it
  is refused, naming both counts. A constant rate, and a run of no updates, are not."""
  for warmup, total in ((5, 5), (8, 3)):
    with pytest.raises(
      ValueError,
      match=rf"lr_decay='{decay}'.*total_updates={total} <= warmup_updates={warmup}",
    ):
      optimizer_lib.optimizer(1e-3, warmup, decay, total)
  optimizer_lib.optimizer(1e-3, 5, "constant", 5)
  optimizer_lib.optimizer(1e-3, 5, decay, 0)
  optimizer_lib.optimizer(1e-3, 5, decay, 6)


def test_placebo_run_trains_on_permuted_rewards_and_logs_the_true_ones(tmp_path):
  """reward_control="shuffle" (the matched placebo), checked by its properties (not by the
  permutation the trainer draws, which may change): the rewards the advantages come from
  are each group's own rearranged within the group (the same multiset per group, not the
  same order), by (seed, step) alone, so the same groups carry advantages; the
  advantages the update used are GRPO's of those rewards, by hand (mean and population std
  of each group of consecutive samples), unlike the true rewards' advantages; the logged
  rewards are the episodes' own."""
  config = _config(
    arm="bf16",
    sft_steps=0,
    eval_every=0,
    checkpoint_every=0,
    minibatches=1,
    reward_control="shuffle",
    seed=3,
    std_norm=True,  # GRPO's advantages, by hand below
  )
  trainer = Trainer(config, str(tmp_path), progress=False)
  spec, state = trainer.spec, trainer.state
  collected = step_lib.collect(spec, trainer.engine, trainer.task, trainer.tokenizer, step=1)
  n = collected.played.rewards.size  # distinct rewards in a fixed order, unrelated to the episodes
  true = (np.random.default_rng(280).permutation(n) / (n - 1)).astype(np.float32)
  collected.played.rewards = true
  state, done = step_lib.update(spec, state, step_lib.score(spec, state, collected, step=1))
  used = np.asarray(step_lib.advantage_rewards(config, 1, true))
  g = config.sampling.group_size
  np.testing.assert_array_equal(  # each group's rewards...
    np.sort(used.reshape(-1, g), axis=1), np.sort(true.reshape(-1, g), axis=1)
  )
  assert not np.array_equal(used, true)  # ...moved within their groups
  # By (seed, step) alone: the same step rearranges the same rewards the same way again,
  # and the steps do not all share one arrangement.
  np.testing.assert_array_equal(step_lib.advantage_rewards(config, 1, true), used)
  assert any(
    not np.array_equal(step_lib.advantage_rewards(config, s, true), used) for s in range(2, 6)
  )

  def grpo_by_hand(r):
    groups = np.asarray(r, np.float64).reshape(-1, config.sampling.group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    return (centred / (groups.std(axis=1, keepdims=True) + 1e-6)).reshape(-1)

  assert config.loss.std_norm and len(done.losses) == 1
  advantages = np.asarray(done.scored.example.advantages)
  np.testing.assert_allclose(advantages, grpo_by_hand(used), atol=1e-5)
  assert not np.allclose(advantages, grpo_by_hand(true), atol=1e-3)
  metrics = step_lib.step_metrics(spec, 1, collected, done, trainer.engine)
  assert metrics["rewards/mean"] == pytest.approx(float(np.mean(true)))
  assert metrics["rewards/std"] == pytest.approx(float(np.std(true)))
  # groups with mixed rewards: all here (distinct rewards), the same share the placebo's
  assert metrics["reward/advantage_mixed_group_frac"] == metrics["reward/mixed_group_frac"] == 1


def test_placebos_keep_or_break_the_groups_that_carry_advantages():
  """Within-group ("shuffle") keeps which groups have mixed rewards; across the batch
  ("shuffle_batch") gives mixed rewards to groups whose samples all agreed. Rewards by
  hand: 8 groups of 4, half all-0 or all-1, half mixed."""
  rng = np.random.default_rng(30)
  groups = np.zeros((8, 4), np.float32)
  groups[0:2] = 1.0  # all succeed
  for i in range(4, 8):  # mixed: one to three successes
    groups[i, rng.choice(4, size=1 + i % 3, replace=False)] = 1.0
  rewards = groups.reshape(-1)
  mixed = lambda r: (r.reshape(-1, 4).max(1) > r.reshape(-1, 4).min(1)).tolist()
  for seed in range(5):
    within = _config(group_size=4, prompts_per_step=8, reward_control="shuffle", seed=seed)
    used = np.asarray(step_lib.advantage_rewards(within, 1, rewards))
    assert mixed(used) == mixed(rewards) == [False] * 4 + [True] * 4
    np.testing.assert_array_equal(used.reshape(-1, 4).sum(1), groups.sum(1))
  batch = _config(group_size=4, prompts_per_step=8, reward_control="shuffle_batch", seed=0)
  used = np.asarray(step_lib.advantage_rewards(batch, 1, rewards))
  np.testing.assert_array_equal(np.sort(used), np.sort(rewards))
  assert sum(mixed(used)) > sum(mixed(rewards))
  plain = _config(group_size=4, prompts_per_step=8)
  assert step_lib.advantage_rewards(plain, 1, rewards) is rewards
