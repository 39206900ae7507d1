"""Durable publication of files and folders: every rename that puts a file or
folder in place is followed by an fsync of the directory it was renamed into (until then
the rename itself can be lost in a power cut), for write_atomic, the checkpoint save and
the metrics rewrite; and a folder is replaced whole (`atomic_directory`)."""

import json
import os
import types

import jax.numpy as jnp
import pytest

from trace_jax.run.checkpoint import Checkpoints
from trace_jax.run.rundir import RunDir
from trace_jax.utils import io


class Recorder:
  """The renames and fsyncs of the process, in order: ("rename", src, dst) and
  ("fsync", path) (path None for a file object opened with `open`)."""

  def __init__(self, monkeypatch):
    self.events, self.paths = [], {}
    real_open, real_fsync = os.open, os.fsync
    real_rename, real_replace, real_close = os.rename, os.replace, os.close

    def open_(path, flags, *args, **kwargs):
      fd = real_open(path, flags, *args, **kwargs)
      self.paths[fd] = os.path.abspath(os.fspath(path))
      return fd

    def close(fd):
      self.paths.pop(fd, None)  # (the number is reused by the next open)
      return real_close(fd)

    def fsync(fd):
      self.events.append(("fsync", self.paths.get(fd if isinstance(fd, int) else fd.fileno())))
      return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
      self.events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))
      return (real_replace if rename.replace else real_rename)(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
      self.events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))
      return real_replace(src, dst, *args, **kwargs)

    rename.replace = False
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "close", close)

  def renames_into(self, directory: str) -> list[int]:
    return [
      i
      for i, e in enumerate(self.events)
      if e[0] == "rename" and os.path.dirname(e[2]) == os.path.abspath(directory)
    ]

  def assert_directory_fsynced_after_renames(self, directory: str) -> None:
    renames = self.renames_into(directory)
    assert renames, f"nothing was renamed into {directory}: {self.events}"
    synced = [i for i, e in enumerate(self.events) if e == ("fsync", os.path.abspath(directory))]
    assert synced and max(synced) > max(renames), (directory, self.events)


def test_write_atomic_fsyncs_the_directory_after_the_rename(tmp_path, monkeypatch):
  recorder = Recorder(monkeypatch)
  payload = os.urandom(513)
  io.write_atomic(str(tmp_path / "d" / "f.bin"), payload)
  recorder.assert_directory_fsynced_after_renames(str(tmp_path / "d"))
  (rename,) = [e for e in recorder.events if e[0] == "rename"]
  assert rename[2] == str(tmp_path / "d" / "f.bin")
  assert (tmp_path / "d" / "f.bin").read_bytes() == payload


def test_checkpoint_save_fsyncs_its_directory_after_publishing_the_step(tmp_path, monkeypatch):
  directory = tmp_path / "run" / "checkpoints"
  checkpoints = Checkpoints(str(directory))
  recorder = Recorder(monkeypatch)
  checkpoints.save(3, {"x": jnp.arange(4.0)}, {"step": 3})
  assert os.path.isdir(directory / "3")
  assert any(e[0] == "rename" and e[2] == str(directory / "3") for e in recorder.events), (
    recorder.events
  )
  recorder.assert_directory_fsynced_after_renames(str(directory))


def test_metrics_rewrite_fsyncs_the_directory(tmp_path, monkeypatch):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "loss": s / 7}) + "\n" for s in range(5)))
  recorder = Recorder(monkeypatch)
  evaluation = types.SimpleNamespace(tensorboard=False, wandb=False)
  rundir = types.SimpleNamespace(
    metrics_path=str(path),
    _events=None,
    _wandb=None,
    config=types.SimpleNamespace(evaluation=evaluation),
  )
  rundir._open_events = lambda records: RunDir._open_events(rundir, records)
  RunDir._truncate_metrics(rundir, 2)  # a resume
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
  recorder.assert_directory_fsynced_after_renames(str(tmp_path))


def test_a_new_log_file_fsyncs_its_directory_once(tmp_path, monkeypatch):
  recorder = Recorder(monkeypatch)
  for step in range(3):
    io.append_jsonl(str(tmp_path / "metrics.jsonl"), {"step": step})
  assert recorder.events.count(("fsync", str(tmp_path))) == 1  # the file's creation


def _files(folder):
  return {
    os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
    for d, _, names in os.walk(folder)
    for n in names
  }


def test_atomic_directory_replaces_a_folder_whole(tmp_path, monkeypatch):
  out = tmp_path / "out"
  with io.atomic_directory(str(out)) as staging:
    for name in ("a.bin", "stale-shard.bin", "index.json"):
      io.write_atomic(os.path.join(staging, name), name.encode())
  assert sorted(os.listdir(out)) == ["a.bin", "index.json", "stale-shard.bin"]
  recorder = Recorder(monkeypatch)
  with io.atomic_directory(str(out)) as staging:
    io.write_atomic(os.path.join(staging, "a.bin"), b"new")
    assert os.path.dirname(staging) == str(tmp_path) and not os.path.exists(out / "b.bin")
  assert _files(out) == {"a.bin": b"new"}  # nothing of the earlier folder survives
  assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging or old folder left beside it
  recorder.assert_directory_fsynced_after_renames(str(tmp_path))
  (published,) = [e for e in recorder.events if e[0] == "rename" and e[2] == str(out)]
  # The staging folder and its file were fsynced before it was renamed into place.
  synced = [e[1] for e in recorder.events[: recorder.events.index(published)] if e[0] == "fsync"]
  assert published[1] in synced and os.path.join(published[1], "a.bin") in synced

  with pytest.raises(RuntimeError, match="half way"):  # an error: the old folder stays
    with io.atomic_directory(str(out)) as staging:
      io.write_atomic(os.path.join(staging, "a.bin"), b"never")
      raise RuntimeError("half way")
  assert _files(out) == {"a.bin": b"new"} and sorted(os.listdir(tmp_path)) == ["out"]


def test_resolve_inside_follows_links_that_stay_in_the_folder_only(tmp_path):
  ckpt = tmp_path / "ckpt"
  (ckpt / "sub").mkdir(parents=True)
  (ckpt / "sub" / "tok.json").write_text("{}")
  (ckpt / "tokenizer.json").symlink_to(os.path.join("sub", "tok.json"))
  (tmp_path / "secret").write_text("key")
  (ckpt / "vocab.json").symlink_to(tmp_path / "secret")
  (ckpt / "merges.txt").symlink_to(os.path.join("..", "secret"))
  via_link = tmp_path / "ckpt_link"
  via_link.symlink_to(ckpt)  # the folder itself may be a link: its real path counts
  assert io.resolve_inside(str(via_link), "tokenizer.json") == str(ckpt / "sub" / "tok.json")
  assert io.resolve_inside(str(ckpt), "absent.json") == str(ckpt / "absent.json")
  for name in ("vocab.json", "merges.txt", os.path.join("..", "secret"), str(tmp_path / "secret")):
    with pytest.raises(ValueError, match=f"leads to {tmp_path / 'secret'}, outside the checkpoint"):
      io.resolve_inside(str(ckpt), name)
  with pytest.raises(ValueError, match="outside"):
    io.resolve_inside(str(ckpt), ".")  # the folder itself is no file of it
  # The hub cache's layout: snapshots/<rev>/ files link to the repo's blobs/, and only there.
  repo = tmp_path / "models--org--m"
  (repo / "snapshots" / "rev").mkdir(parents=True)
  (repo / "blobs").mkdir()
  (repo / "blobs" / "ab12").write_text("{}")
  (repo / "snapshots" / "rev" / "config.json").symlink_to(os.path.join("..", "..", "blobs", "ab12"))
  (repo / "other").write_text("{}")
  (repo / "snapshots" / "rev" / "vocab.json").symlink_to(os.path.join("..", "..", "other"))
  assert io.resolve_inside(str(repo / "snapshots" / "rev"), "config.json") == str(
    repo / "blobs" / "ab12"
  )
  with pytest.raises(ValueError, match="outside"):
    io.resolve_inside(str(repo / "snapshots" / "rev"), "vocab.json")


def test_atomic_directory_refuses_a_symlink_and_write_atomic_follows_the_umask(tmp_path):
  real = tmp_path / "real"
  real.mkdir()
  (real / "kept.bin").write_bytes(b"kept")
  (tmp_path / "link").symlink_to(real)
  with pytest.raises(ValueError, match="link is a symbolic link"):
    with io.atomic_directory(str(tmp_path / "link")):
      raise AssertionError("entered")
  assert os.path.islink(tmp_path / "link") and _files(real) == {"kept.bin": b"kept"}
  assert sorted(os.listdir(tmp_path)) == ["link", "real"]
  previous = os.umask(0o026)
  try:
    io.write_atomic(str(tmp_path / "a.json"), "{}")
  finally:
    os.umask(previous)
  assert os.stat(tmp_path / "a.json").st_mode & 0o777 == 0o640
  assert sorted(os.listdir(tmp_path)) == ["a.json", "link", "real"]  # no temporary file left
