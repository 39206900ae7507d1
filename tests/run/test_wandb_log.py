"""--wandb: the run's metrics and config in a Weights & Biases run, beside TensorBoard, read
back from the offline run's own files; a resume after a crash continues the same W&B run and
logs each step once; without the wandb package the flag is refused in one line."""

import glob
import json
import struct
import sys

import numpy as np
import pytest

from trace_jax.rl.config import RLConfig
from trace_jax.run.rundir import RunDir, read_metrics

BASE = dict(
  preset="tiny",
  task="arith",
  checkpoint_every=0,
  eval_every=0,
  tensorboard=False,
  lr_decay="constant",
)


def _config(**overrides) -> RLConfig:
  return RLConfig.from_flat(**{**BASE, "wandb": True, **overrides})


def test_wandb_without_the_package_is_refused_naming_the_extra(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  with pytest.raises(ValueError) as refused:
    RunDir(str(tmp_path / "run"), _config())
  message = str(refused.value)
  assert message.startswith("--wandb needs the wandb package (") and "\n" not in message
  assert "pip install 'trace_jax[wandb]' (the wandb extra), or run without --wandb" in message
  RunDir(str(tmp_path / "run"), _config(wandb=False)).close()  # the flag alone needs it


def _records(path: str):
  """The protobuf records of a W&B transaction log (.wandb): a 7-byte header (":W&B", magic
  0xBEE1, version 0), then LevelDB-log framing: 32 KiB blocks of chunks, each a CRC32C, a
  length and a type (1 full, 2 first, 3 middle, 4 last) before its bytes."""
  from wandb.proto import wandb_internal_pb2

  with open(path, "rb") as f:
    data = f.read()
  assert data[:7] == b":W&B\xe1\xbe\x00"
  position, pending = 7, b""
  while position + 7 <= len(data):
    left = 32768 - position % 32768
    if left < 7:  # a block's tail too short for a chunk header is padding
      position += left
      continue
    _, length, kind = struct.unpack("<IHB", data[position : position + 7])
    pending += data[position + 7 : position + 7 + length]
    position += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      pending = b""
      yield record


def _offline_runs(root) -> list[dict]:
  """Every offline run under WANDB_DIR, in start order: its id, config and history rows."""
  runs = []
  for path in sorted(glob.glob(str(root / "wandb" / "offline-run-*" / "*.wandb"))):
    run = {"id": None, "config": {}, "history": [], "start": 0}
    for record in _records(path):
      kind = record.WhichOneof("record_type")
      if kind == "run":
        run["id"] = record.run.run_id
        run["start"] = record.run.start_time.ToNanoseconds()
      elif kind == "config":
        updates = record.config.update
        run["config"].update(
          {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates}
        )
      elif kind == "history":
        items = record.history.item  # a key is `key`, or its parts in `nested_key`
        run["history"].append(
          {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
        )
    runs.append(run)
  # directory names carry the start to the second only: order by the recorded start
  return sorted(runs, key=lambda run: run["start"])


def _line(rng, step: int) -> dict:
  return {
    "step": step,
    "rewards/mean": float(rng.uniform()),
    "mismatch/k3_kl": float(rng.lognormal(-8, 2)),
    "tokens": int(rng.integers(1, 10_000)),
    "arm": "trace",  # neither strings, None, booleans nor lists are scalars
    "eval/reward_fp4": None,
    "stopped": False,
    "per_layer": [1.0, 2.0],
  }


def test_a_resumed_run_continues_the_w_and_b_run_with_each_step_once(tmp_path, monkeypatch):
  """A crash after step 5 with the newest checkpoint at step 3: metrics.jsonl is cut back to
  3 and steps 4-6 logged again (the same values: a resume is exact); the W&B history of both
  starts, one run id, holds every step 0-6 once with metrics.jsonl's numbers, and the run's
  config is the RLConfig. A run that turns --wandb on at its resume logs its earlier lines."""
  pytest.importorskip("wandb", reason="the wandb extra (pip install 'trace_jax[wandb]')")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  (tmp_path / "wandb_dir").mkdir()
  rng = np.random.default_rng(0)
  lines = [{"step": 0, "eval/reward_fp4": 0.25}] + [_line(rng, step) for step in range(1, 7)]
  workdir = tmp_path / "run"
  config = _config()
  crashed = RunDir(str(workdir), config)
  for line in lines[:6]:
    crashed.log(line)
  crashed._wandb.close()  # what reached W&B before the crash
  crashed._unlock()  # the process died: its lock went with it; nothing else was closed
  resumed = RunDir(str(workdir), config.replace(steps=7))  # steps may change on a resume
  try:
    resumed._truncate_metrics(3)  # what `restore` does with a checkpoint at step 3
    for line in lines[4:]:
      resumed.log(line)
  finally:
    resumed.close()
  assert [r["step"] for r in read_metrics(str(workdir))] == list(range(7))
  runs = _offline_runs(tmp_path / "wandb_dir")
  assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]
  state = json.loads((workdir / "wandb.json").read_text())
  assert state == {"run_id": runs[0]["id"], "logged_through": 6}
  history = runs[0]["history"] + runs[1]["history"]
  assert [row["_step"] for row in history] == list(range(7))
  for row, line in zip(history, read_metrics(str(workdir))):
    want = {k: v for k, v in line.items() if k != "step" and type(v) in (int, float)}
    assert {k: v for k, v in row.items() if not k.startswith("_")} == pytest.approx(want)
  assert runs[0]["config"]["source"] == config.to_dict()["source"]
  assert runs[1]["config"]["schedule"]["steps"] == 7
  # --wandb turned on at a resume: the lines before it are logged then, once
  later = tmp_path / "later"
  first = RunDir(str(later), _config(wandb=False))
  for line in lines[:3]:
    first.log(line)
  first.close()
  on = RunDir(str(later), _config())
  try:
    on._truncate_metrics(2)
    on.log(lines[3])
  finally:
    on.close()
  runs = _offline_runs(tmp_path / "wandb_dir")
  assert len(runs) == 3 and [row["_step"] for row in runs[2]["history"]] == [0, 1, 2, 3]
