"""The slot pool (RolloutConfig.slots): in float32, every sequence's tokens, log-probs,
guidance and routing records equal the static engine's for pools of 1, 3 and 16 slots, on a
single turn and a continuation; a group's prompt is prefilled once; the stats it reports."""

import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from trace_jax import rollout as R
from trace_jax.model.sharding import make_mesh
from trace_jax.rollout import pool as pool_lib
from trace_jax.rollout.decode import POOL_CHECK_EVERY

# Two groups of identical prompts (GRPO samples), two single prompts.
PROMPTS = [[5, 17, 3]] * 3 + [[9, 2, 44, 7, 61, 8, 30], [100], [1, 2, 3, 4], [1, 2, 3, 4]]
BUDGETS = [8, 3, 8, 6, 8, 2, 8]
OBSERVATIONS = [[7, 7, 7], [], [12], [50, 51], [], [3], [4, 4]]


def _config(precision):
  return R.RolloutConfig(
    precision=precision,
    compute_dtype="float32",
    guidance="none" if precision == "bf16" else "compact",
    guided_layers="all",
    max_len=56,
    prompt_bucket=8,
    sampling=R.SamplingConfig(max_new_tokens=8, stop_tokens=tuple(range(0, 16, 2))),
  )


def _play(engine):
  """A first turn (per-sequence budgets) and a continuation of it, both on the host."""
  first = engine.generate(
    PROMPTS, jax.random.key(3), sequences=range(10, 10 + len(PROMPTS)), max_new_tokens=BUDGETS
  )
  host = first.without_cache()
  ids = range(10, 10 + len(PROMPTS))
  second = engine.continue_(first, OBSERVATIONS, jax.random.key(4), sequences=ids)
  return host, second.without_cache()


def _assert_same(static, pool):
  """Per sequence: real tokens, masks, finish reasons, log-probs (to rounding), routing
  and guidance records at every real slot."""
  assert pool.sequences() == static.sequences()
  assert pool.finish_reasons() == static.finish_reasons()
  real, response = np.asarray(static.mask), np.asarray(static.response_mask)
  for field in ("prompt_mask", "response_mask", "env_mask"):
    np.testing.assert_array_equal(getattr(pool, field), getattr(static, field))
  np.testing.assert_array_equal(
    np.asarray(pool.positions)[real], np.asarray(static.positions)[real]
  )
  for field in ("logprobs", "sampling_logprobs"):
    a, b = np.asarray(getattr(pool, field))[response], np.asarray(getattr(static, field))[response]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
  np.testing.assert_array_equal(
    np.asarray(pool.routing)[:, real], np.asarray(static.routing)[:, real]
  )
  assert (static.guidance is None) == (pool.guidance is None)
  if static.guidance is not None:
    for key, record in static.guidance.sites.items():
      for a, b in zip(jax.tree.leaves(pool.guidance.sites[key]), jax.tree.leaves(record)):
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
      np.asarray(pool.guidance.routing)[:, real], np.asarray(static.guidance.routing)[:, real]
    )


@pytest.fixture(scope="module")
def static_bf16(policy):
  return _play(R.RolloutEngine(policy, _config("bf16")))


@pytest.mark.parametrize("slots", [1, 3, 16])
def test_a_pool_of_any_size_gives_the_static_engines_rollout(policy, static_bf16, slots):
  """bf16 weights in float32: one turn with per-sequence budgets and stop tokens, then a
  continuation (an empty observation ends an episode), each equal to the static engine's."""
  engine = R.RolloutEngine(policy, _config("bf16").replace(slots=slots))
  first, second = _play(engine)
  assert "stop" in first.finish_reasons() and "length" in first.finish_reasons()
  _assert_same(static_bf16[0], first)
  _assert_same(static_bf16[1], second)
  stats = engine.take_stats()
  assert stats.generated == int(np.asarray(second.response_lengths).sum())
  assert stats.slot_steps >= stats.generated and stats.slot_steps % slots == 0
  every = engine.statics.stop_every
  assert every == POOL_CHECK_EVERY  # the pool's own default: no host sync per token
  if slots == 1:  # one slot idles only between its sequence's end and the next check
    turns = len(PROMPTS) + sum(1 for o in OBSERVATIONS if o)
    assert stats.slot_steps - stats.generated <= (every - 1) * turns


def test_a_pool_checked_every_step_never_idles_a_single_slot(policy, static_bf16):
  """stop_check_every=1: one slot refilled at every step runs no idle step, and the rollout
  is the same."""
  config = _config("bf16")
  sampling = dataclasses.replace(config.sampling, stop_check_every=1)
  engine = R.RolloutEngine(policy, config.replace(slots=1, sampling=sampling))
  first, second = _play(engine)
  _assert_same(static_bf16[1], second)
  stats = engine.take_stats()
  assert stats.slot_steps == stats.generated


@pytest.mark.slow
def test_an_fp4_pool_records_the_static_engines_guidance(policy):
  """FP4 with compact guidance on every layer, in float32: a pool of 3 gives the static
  engine's tokens, log-probs, guidance and routing, over a turn and a continuation."""
  static = _play(R.RolloutEngine(policy, _config("fp4")))
  pool = _play(R.RolloutEngine(policy, _config("fp4").replace(slots=3)))
  for a, b in zip(static, pool):
    _assert_same(a, b)


@pytest.mark.parametrize("slots", [16, 2])
def test_a_groups_prompt_is_prefilled_once(policy, monkeypatch, slots):
  """Identical consecutive prompts (a group) share one prefilled row: the prefill programs
  run here fill 4 rows for 7 sequences (groups of 3, 1, 1 and 2), and the stats say so; with
  2 slots the group of 3 enters over two refills and is still prefilled once."""
  filled = []
  program = pool_lib.prefill_program

  def counting(graphdef, params, prompt, prompt_mask, *rest):
    rows = {tuple(np.asarray(t)[np.asarray(m)]) for t, m in zip(prompt, prompt_mask)}
    filled.append(len(rows))  # distinct prompts (a bucket's padding repeats one)
    return program(graphdef, params, prompt, prompt_mask, *rest)

  monkeypatch.setattr(pool_lib, "prefill_program", counting)
  engine = R.RolloutEngine(policy, _config("bf16").replace(slots=slots))
  engine.generate(PROMPTS, jax.random.key(3))
  assert sum(filled) == 4 and (slots == 2 or filled == [4])
  stats = engine.take_stats()
  assert (stats.prefilled, stats.sequences) == (4, 7)
  metrics = stats.metrics()
  assert metrics["rollout/prefill_shared_frac"] == pytest.approx(3 / 7)
  assert 0 < metrics["rollout/slot_utilization"] <= 1


def test_stats_of_the_static_engine_and_bad_slots(policy):
  """The static engine's stats: its batch times the longest response as slot-steps, every
  sequence prefilled alone. slots must be None or an int >= 0."""
  engine = R.RolloutEngine(policy, _config("bf16"))
  rollout = engine.generate(PROMPTS, jax.random.key(3), max_new_tokens=BUDGETS)
  lengths = np.asarray(rollout.response_lengths)
  stats = engine.take_stats()
  assert stats.generated == lengths.sum()
  assert stats.slot_steps == len(PROMPTS) * lengths.max()
  assert stats.metrics()["rollout/prefill_shared_frac"] == 0.0
  assert engine.take_stats().generated == 0  # taken: reset
  for bad in (-1, 2.5, True):
    with pytest.raises(ValueError, match=f"slots={bad!r}"):
      _config("bf16").replace(slots=bad)


def test_a_pool_on_a_one_device_mesh_gives_the_static_engines_rollout(policy, static_bf16):
  """The mesh's sharding constraints in the pool's programs change no number."""
  mesh = make_mesh(devices=jax.devices()[:1])
  engine = R.RolloutEngine(policy, _config("bf16").replace(slots=3), mesh=mesh)
  first, second = _play(engine)
  _assert_same(static_bf16[0], first)
  _assert_same(static_bf16[1], second)


ON_FOUR_DEVICES = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 " + os.environ.get("XLA_FLAGS", "")
import jax
jax.config.update("jax_default_matmul_precision", "highest")
from flax import nnx
from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.model.sharding import make_mesh
from tests.rollout import test_pool as t

policy = M.Transformer(M.tiny(), rngs=nnx.Rngs(0))
t.PROMPTS, t.BUDGETS, t.OBSERVATIONS = t.PROMPTS + [[3, 3]], t.BUDGETS + [5], t.OBSERVATIONS + [[9]]
mesh = make_mesh(2, 1, 2)  # data 2 (the slots and each prefill's rows), model 2
static = t._play(R.RolloutEngine(policy, t._config(sys.argv[1]), mesh=mesh))
for slots in (2, 6):
  pool = t._play(R.RolloutEngine(policy, t._config(sys.argv[1]).replace(slots=slots), mesh=mesh))
  for a, b in zip(static, pool):
    t._assert_same(a, b)
try:
  R.RolloutEngine(policy, t._config("bf16").replace(slots=3), mesh=mesh)
except ValueError as e:
  print("refused:", e)
print("same")
"""


@pytest.mark.slow  # ~40 s each; the 1-device mesh above runs by default
@pytest.mark.parametrize("precision", ["bf16", "fp4"])
def test_a_pool_on_a_mesh_gives_the_static_engines_rollout_on_that_mesh(precision):
  """4 CPU devices (a subprocess), a (data 2, model 2) mesh: pools of 2 and 6 slots give the
  static engine's rollout on that mesh over a turn and a continuation; 3 slots, which do
  not split over 2 data shards, are refused by name."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run(
    [sys.executable, "-c", ON_FOUR_DEVICES, precision],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    cwd=root,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  lines = result.stdout.splitlines()
  assert lines[-1] == "same"
  assert "RolloutConfig.slots=3 on a mesh of 2 data shards" in lines[-2], lines
