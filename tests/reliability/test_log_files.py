"""metrics.jsonl and other files under crashes and a full disk: a torn
last line (an append cut short) is dropped with a warning instead of making the workdir
impossible to resume; damage elsewhere names the file and the line; a write that fails
leaves the previous file whole and names the path."""

import json
import os
import random

import pytest

from tests.reliability.reliability_helpers import fill, full_filesystem
from trace_jax.run.rundir import read_metrics
from trace_jax.utils import append_jsonl, read_jsonl, write_atomic, write_json


def _records(n, seed=0):
  rng = __import__("random").Random(seed)
  return [
    {"step": s, "rewards/mean": rng.random(), "mismatch/k3_kl": rng.random() * 1e-3}
    for s in range(n)
  ]


@pytest.mark.parametrize("cut", [1, 5, 17])
def test_torn_last_line_is_dropped_and_said(tmp_path, caplog, cut):
  records = _records(4, seed=cut)
  text = "".join(json.dumps(r) + "\n" for r in records)
  torn = json.dumps({"step": 4, "rewards/mean": 0.25})[:cut]  # e.g. '{"ste'
  (tmp_path / "metrics.jsonl").write_text(text + torn)
  assert read_metrics(str(tmp_path)) == records
  assert "dropped a torn last line" in caplog.text and "metrics.jsonl" in caplog.text


def test_damaged_line_before_the_end_names_the_file_and_line(tmp_path):
  lines = [json.dumps(r) for r in _records(3)]
  lines[1] = lines[1][:9] + "\x00garbage"
  path = tmp_path / "metrics.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=rf"{path}, line 2: not valid JSON .*delete that line"):
    read_jsonl(str(path))


def test_appends_and_rewrites_on_a_full_disk(tmp_path, monkeypatch):
  with full_filesystem(tmp_path / "fs", size_kib=64) as mounted:
    path = tmp_path / "fs" / "metrics.jsonl"
    summary = tmp_path / "fs" / "summary.json"
    records = _records(3)
    for r in records:
      append_jsonl(str(path), r)
    write_json(str(summary), {"steps": 3})
    big = {"step": 3, "blob": "x" * 20_000}
    if mounted:
      fill(str(tmp_path / "fs"), leave_bytes=6_000)
    else:  # no mount allowed here: every write reports a full disk after 6000 bytes
      real_open = open

      class Full:
        def __init__(self, f):
          self.f, self.left = f, 6_000

        def write(self, data):
          if len(data) > self.left:
            self.f.write(data[: self.left])
            self.f.flush()
            raise OSError(28, "No space left on device")
          self.left -= len(data)
          return self.f.write(data)

        def __getattr__(self, name):
          return getattr(self.f, name)

        def __enter__(self):
          return self

        def __exit__(self, *exc):
          return self.f.__exit__(*exc)

      monkeypatch.setattr("builtins.open", lambda *a, **k: Full(real_open(*a, **k)))
      monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: Full(real_open(fd, *a, **k)))
    with pytest.raises(OSError, match=rf"could not append to {path}: No space left on device"):
      append_jsonl(str(path), big)
    with pytest.raises(OSError, match=rf"could not write {summary}: No space left on device"):
      write_json(str(summary), big)
    monkeypatch.undo()
    assert read_jsonl(str(path)) == records  # the torn append dropped, the rest intact
    assert json.loads(summary.read_text()) == {"steps": 3}  # the old file, whole
    assert sorted(os.listdir(tmp_path / "fs")) in (
      ["filler", "metrics.jsonl", "summary.json"],
      ["metrics.jsonl", "summary.json"],
    )


def test_write_atomic_replaces_whole(tmp_path):
  path = tmp_path / "a" / "file.bin"
  payload = random.Random(95).randbytes(1000)
  write_atomic(str(path), payload)
  assert path.read_bytes() == payload and os.listdir(tmp_path / "a") == ["file.bin"]
