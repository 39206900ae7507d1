"""The SFT warm start's batch on a mesh (trace_jax/run/warmstart.py): padded to the data axis
with rows that change no loss. (That each device holds its rows is checked on 8 fake
devices in tests/model/test_sharding.py.)"""

import chex
import jax
import numpy as np
from flax import nnx

from trace_jax import model as M
from trace_jax.run import warmstart
from trace_jax.training.sft import sft_batch, sft_loss


def test_padding_rows_change_no_loss():
  rng = np.random.default_rng(16)
  pairs = [
    (
      rng.integers(1, 128, rng.integers(2, 6)).tolist(),
      rng.integers(1, 128, rng.integers(1, 5)).tolist(),
    )
    for _ in range(3)
  ]
  batch = sft_batch(pairs, 12, pad_id=0)
  padded = warmstart.pad_rows(batch, 4)
  assert [a.shape[0] for a in padded] == [4, 4, 4]
  chex.assert_trees_all_equal([a[:3] for a in padded], [np.asarray(a) for a in batch])
  assert not padded[1][3:].any() and not padded[2][3:].any()
  assert all(a.shape[0] == 3 for a in warmstart.pad_rows(batch, 3))  # already a multiple
  model = M.Transformer(M.tiny(), rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  loss = jax.jit(lambda t, l, v: sft_loss(model, t, l, v))
  want, got = loss(*batch), loss(*padded)
  assert float(want[1]) > 0
  chex.assert_trees_all_close(got, want, rtol=1e-6)


def test_a_warm_start_is_reused_only_for_its_own_settings(tmp_path):
  """The saved warm start carries its settings; the same settings load it
  (the very parameters), any other setting is refused naming the field and both values,
  and a warm start saved without settings is refused too, never reused silently."""
  import json

  import pytest

  from trace_jax.tasks import CharTokenizer, get_task

  task, tokenizer = get_task("arith"), CharTokenizer()
  cfg = M.tiny(vocab_size=max(M.tiny().vocab_size, tokenizer.vocab_size))
  source = warmstart.source_settings(model="tiny")
  make = dict(steps=2, batch=4, seed=1, learning_rate=1e-3, source=source, progress=False)
  first = M.Transformer(cfg, rngs=nnx.Rngs(1))
  record = warmstart.load_or_train(first, str(tmp_path), task, tokenizer, **make)
  assert not record["loaded"] and record["settings"]["sft_steps"] == 2
  again = M.Transformer(cfg, rngs=nnx.Rngs(2))  # other initial weights: the load replaces them
  assert warmstart.load_or_train(again, str(tmp_path), task, tokenizer, **make)["loaded"]
  chex.assert_trees_all_equal(nnx.state(again, nnx.Param), nnx.state(first, nnx.Param))
  for change, message in (
    (dict(steps=3), "sft_steps: saved 2, this run 3"),
    (dict(seed=2), "seed: saved 1, this run 2"),
    (dict(source=warmstart.source_settings(model="small")), "model: saved 'tiny', this run"),
    (
      dict(source=warmstart.source_settings(model="tiny", task_options=(("terms", 3),))),
      "task_options: saved",
    ),
  ):
    with pytest.raises(ValueError, match=message):
      warmstart.load_or_train(again, str(tmp_path), task, tokenizer, **{**make, **change})
  with pytest.raises(ValueError, match="task: saved 'arith', this run 'chain'"):
    warmstart.load_or_train(again, str(tmp_path), get_task("chain"), tokenizer, **make)
  path = tmp_path / "warmstart" / "warmstart.json"
  old = json.loads(path.read_text())
  del old["settings"]  # as saved before warm starts recorded their settings
  path.write_text(json.dumps(old))
  with pytest.raises(ValueError, match="not recorded"):
    warmstart.load_or_train(again, str(tmp_path), task, tokenizer, **make)


def test_a_warm_start_stops_at_its_target_level(tmp_path, monkeypatch):
  """--sft_target ends the SFT at the first check (every LEVEL_EVERY steps) whose
  greedy FP4 reward on training problems reaches it. Unreached, every step runs and each
  check is recorded, the last one equal to an independent greedy play of the saved policy;
  reached, the SFT stops there. The target keys the warm start like any setting."""
  import pytest

  from trace_jax.rl import episodes
  from trace_jax.rl.config import RLConfig
  from trace_jax.run import policy_source
  from trace_jax.rollout.engine import RolloutEngine
  from trace_jax.tasks import get_task

  config = RLConfig.from_flat(task="arith", preset="tiny", max_new_tokens=8)
  task = get_task("arith")
  source = policy_source.load(config, task)
  _, greedy = episodes.rollout_configs(config, task, source)
  monkeypatch.setattr(warmstart, "LEVEL_PROBLEMS", 16)
  monkeypatch.setattr(warmstart, "LEVEL_EVERY", 2)  # the test's scale: 4 steps, checks at 2, 4
  seed = int(np.random.default_rng().integers(1 << 20))
  make = dict(
    steps=4,
    batch=4,
    seed=seed,
    learning_rate=3e-3,
    source=warmstart.source_settings(model="tiny"),
    greedy=greedy,
    progress=False,
  )
  policy = source.policy
  record = warmstart.load_or_train(
    policy, str(tmp_path / "unreached"), task, source.tokenizer, target=1.5, **make
  )
  assert record["steps"] == 4 and [c[0] for c in record["checks"]] == [2, 4]
  items = task.sample(seed, 16, "train")
  engine = RolloutEngine(policy, greedy.replace(precision="fp4"))
  played = episodes.play(engine, task, source.tokenizer, items, jax.random.key(0))
  assert record["checks"][-1][1] == pytest.approx(float(np.mean(played.rewards)))
  with pytest.raises(ValueError, match="sft_target: saved 1.5, this run 0.5"):
    warmstart.load_or_train(
      policy, str(tmp_path / "unreached"), task, source.tokenizer, target=0.5, **make
    )
  # every answer right: the first check reaches the target, and the SFT ends there
  monkeypatch.setattr(type(task), "score", lambda self, item, text: 1.0)
  record = warmstart.load_or_train(
    policy, str(tmp_path / "reached"), task, source.tokenizer, target=0.5, **make
  )
  assert record["steps"] == 2 and record["checks"] == [[2, 1.0]]
  with pytest.raises(ValueError, match="needs the run's greedy RolloutConfig"):
    warmstart.load_or_train(
      policy, str(tmp_path / "none"), task, source.tokenizer, target=0.5, **{**make, "greedy": None}
    )
  assert not (tmp_path / "none" / "warmstart").exists()


def _flip_bit(path: str, offset_fraction: float = 0.5, bit: int = 4) -> None:
  data = bytearray(open(path, "rb").read())
  data[int(len(data) * offset_fraction)] ^= 1 << bit
  open(path, "wb").write(bytes(data))


def test_a_damaged_warm_start_is_rebuilt_and_says_so(tmp_path, capsys):
  """A saved warm start is verified on reload as RL checkpoints are: a flipped bit in an
  array file (which orbax restores without complaint) or a truncated one is caught, the
  warm start rebuilt from the untouched initial weights, and the record and a printed line
  say why."""
  import glob
  import os

  from trace_jax.tasks import CharTokenizer, get_task

  task, tokenizer = get_task("arith"), CharTokenizer()
  cfg = M.tiny(vocab_size=max(M.tiny().vocab_size, tokenizer.vocab_size))
  seed = int(np.random.default_rng().integers(1 << 20))
  make = dict(
    steps=2, batch=4, seed=1, learning_rate=1e-3, source=warmstart.source_settings(model="tiny")
  )
  first = M.Transformer(cfg, rngs=nnx.Rngs(seed))
  record = warmstart.load_or_train(first, str(tmp_path), task, tokenizer, progress=False, **make)
  assert not record["loaded"]
  made = nnx.state(first, nnx.Param)
  files = glob.glob(str(tmp_path / "warmstart" / "params" / "**" / "d" / "*"), recursive=True)
  largest = max(files, key=os.path.getsize)

  for damage, reason in (
    (_flip_bit, "arrays differ from the checksums saved with them"),
    (lambda f: open(f, "r+b").truncate(os.path.getsize(f) // 2), "arrays do not restore"),
  ):
    damage(largest)
    capsys.readouterr()
    policy = M.Transformer(cfg, rngs=nnx.Rngs(seed))  # the same initial weights
    record = warmstart.load_or_train(policy, str(tmp_path), task, tokenizer, progress=False, **make)
    assert not record["loaded"] and reason in record["rebuilt"], record
    line = capsys.readouterr().out
    assert f"the warm start in {tmp_path / 'warmstart'} is damaged" in line and reason in line
    # rebuilt from the initial weights: the warm start first made, now saved whole again
    chex.assert_trees_all_equal(nnx.state(policy, nnx.Param), made)
    again = M.Transformer(cfg, rngs=nnx.Rngs(seed + 1))
    record = warmstart.load_or_train(again, str(tmp_path), task, tokenizer, progress=False, **make)
    assert record["loaded"] and "rebuilt" not in record and "checksums" not in record
    chex.assert_trees_all_equal(nnx.state(again, nnx.Param), made)
    files = glob.glob(str(tmp_path / "warmstart" / "params" / "**" / "d" / "*"), recursive=True)
    largest = max(files, key=os.path.getsize)
