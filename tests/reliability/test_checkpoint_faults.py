"""Checkpoints under damage and a full disk: restore uses the newest
checkpoint that restores and verifies, says which it skipped and why, cleans stale
temporary directories; a full disk during a save leaves the previous checkpoints usable
and says so in one line."""

import errno
import glob
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.path import atomicity

from tests.reliability.reliability_helpers import fill, full_filesystem
from trace_jax.run.checkpoint import CheckpointError, Checkpoints


def _state(seed: int) -> dict:
  key = jax.random.key(seed)
  return {
    "policy": {
      "w": jax.random.normal(key, (32, 128)),
      "b": jax.random.uniform(jax.random.fold_in(key, 1), (7,)),
    },
    "count": jnp.int32(seed),
  }


def _saved(directory, steps=(1, 2)) -> Checkpoints:
  checkpoints = Checkpoints(str(directory))
  for step in steps:
    checkpoints.save(step, _state(step), {"step": step})
  return checkpoints


def _data_files(directory, step):
  files = glob.glob(
    os.path.join(str(directory), str(step), "state", "**", "d", "*"), recursive=True
  )
  return sorted((f for f in files if os.path.isfile(f)), key=os.path.getsize)


def _flip_bit(path, offset_fraction=0.5, bit=4):
  data = bytearray(open(path, "rb").read())
  data[int(len(data) * offset_fraction)] ^= 1 << bit
  open(path, "wb").write(bytes(data))


def test_flipped_bit_is_caught_by_the_checksum_and_the_previous_checkpoint_used(tmp_path, caplog):
  _saved(tmp_path)
  _flip_bit(_data_files(tmp_path, 2)[-1])
  # Orbax itself reads the damaged array without complaint (what the old code restored).
  like = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(0))
  raw = ocp.CheckpointManager(str(tmp_path)).restore(
    2, args=ocp.args.Composite(state=ocp.args.StandardRestore(like))
  )["state"]
  assert not np.array_equal(raw["policy"]["w"], _state(2)["policy"]["w"])

  checkpoints = Checkpoints(str(tmp_path))
  step, restored, meta = checkpoints.restore_latest(_state(0))
  assert step == 1 and meta["step"] == 1
  chex.assert_trees_all_equal(restored, _state(1))
  assert checkpoints.skipped[0][0] == 2 and "differ from the checksums" in checkpoints.skipped[0][1]
  assert "checkpoint step 2" in caplog.text and "does not restore" in caplog.text
  assert checkpoints.all_steps() == [1]  # step 2 moved to <dir>_unusable, not deleted
  assert os.listdir(f"{tmp_path}_unusable")[0].startswith("2-")
  checkpoints.save(2, _state(2), {"step": 2})  # its step number is free again
  assert checkpoints.restore_latest(_state(0))[0] == 2


def test_truncated_file_falls_back(tmp_path):
  _saved(tmp_path)
  largest = _data_files(tmp_path, 2)[-1]
  with open(largest, "r+b") as f:
    f.truncate(os.path.getsize(largest) // 2)
  checkpoints = Checkpoints(str(tmp_path))
  step, restored, _ = checkpoints.restore_latest(_state(0))
  assert step == 1
  chex.assert_trees_all_equal(restored, _state(1))
  assert [s for s, _ in checkpoints.skipped] == [2]


def test_checkpoint_holding_nan_is_not_restored(tmp_path):
  checkpoints = _saved(tmp_path, steps=(1,))
  bad = _state(2)
  bad["policy"]["w"] = bad["policy"]["w"].at[3, 4].set(jnp.nan)
  checkpoints.save(2, bad, {"step": 2})
  step, _, _ = Checkpoints(str(tmp_path)).restore_latest(_state(0))
  assert step == 1


def test_no_checkpoint_restores_names_the_directory_and_moves_nothing(tmp_path):
  _saved(tmp_path)
  for step in (1, 2):
    with open(_data_files(tmp_path, step)[-1], "r+b") as f:
      f.truncate(10)
  with pytest.raises(
    CheckpointError,
    match=rf"no checkpoint in {tmp_path} restores \(step 2: "
    r".*step 1: .*\)\. Move that directory away",
  ):
    Checkpoints(str(tmp_path)).restore_latest(_state(0))
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]
  assert Checkpoints(str(tmp_path / "empty")).restore_latest(_state(0)) is None


def test_stale_temporary_directories_are_cleaned(tmp_path):
  _saved(tmp_path, steps=(1,))
  stale = tmp_path / "2.orbax-checkpoint-tmp-1764500000"  # what a SIGKILL mid-save leaves
  (stale / "state").mkdir(parents=True)
  (stale / "state" / "partial").write_bytes(np.random.default_rng(115).bytes(100))
  checkpoints = Checkpoints(str(tmp_path))
  assert not stale.exists()
  assert checkpoints.all_steps() == [1]


def _check_full_disk_error(error: CheckpointError, directory) -> None:
  assert str(error) == (
    f"could not save checkpoint step 2 in {directory}: no space left on "
    f"device; the previous checkpoints (steps [1]) are intact; a rerun "
    f"resumes from step 1. Free space (or fix the cause) and rerun."
  )


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, capfd, monkeypatch):
  with full_filesystem(tmp_path / "fs") as mounted:
    directory = tmp_path / "fs" / "checkpoints"
    checkpoints = _saved(directory, steps=(1,))
    if mounted:  # a real full filesystem: the array writes fail inside TensorStore
      fill(str(tmp_path / "fs"), leave_bytes=4096)
    else:  # no mount allowed here: the commit of the written step fails with ENOSPC

      async def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.get()))

      monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", no_space)
    capfd.readouterr()
    with pytest.raises(CheckpointError) as caught:
      checkpoints.save(2, _state(2), {"step": 2})
    _check_full_disk_error(caught.value, directory)
    err = capfd.readouterr().err
    assert len(err.splitlines()) <= 2, err[:3000]  # no pages of orbax / event-loop noise
    assert sorted(os.listdir(directory)) == ["1"]  # nothing partial left
    monkeypatch.undo()
    step, restored, _ = Checkpoints(str(directory)).restore_latest(_state(0))
    assert step == 1
    chex.assert_trees_all_equal(restored, _state(1))


@pytest.mark.parametrize("when", ["before_publishing", "after_publishing"])
def test_ctrl_c_during_a_save_leaves_a_whole_checkpoint_or_none(tmp_path, capfd, monkeypatch, when):
  """KeyboardInterrupt mid-save goes on, with no writer thread failing after it: a step not
  yet renamed into place leaves nothing (its temporary directory removed), one already
  published is kept whole; the steps listed are the ones on disk."""
  checkpoints = _saved(tmp_path, steps=(1,))
  if when == "before_publishing":

    async def interrupted(self, *args, **kwargs):
      raise KeyboardInterrupt

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", interrupted)
  else:
    monkeypatch.setattr(
      "trace_jax.run.checkpoint.fsync_directory",
      lambda path: (_ for _ in ()).throw(KeyboardInterrupt),
    )
  capfd.readouterr()
  with pytest.raises(KeyboardInterrupt):
    checkpoints.save(2, _state(2), {"step": 2})
  assert "Traceback" not in capfd.readouterr().err
  monkeypatch.undo()
  saved = [1] if when == "before_publishing" else [2, 1]
  assert checkpoints.all_steps() == saved
  assert sorted(os.listdir(tmp_path)) == sorted(map(str, saved))
  step, restored, _ = Checkpoints(str(tmp_path)).restore_latest(_state(0))
  assert step == saved[0]
  chex.assert_trees_all_equal(restored, _state(step))
