"""Rollouts and learning on disjoint device groups (RLConfig.rollout_devices): the guarantees,
on 8 CPU devices in one subprocess (`device_groups_runs.py`: seven tiny runs, ~1.5-2 min on
2 cores, shared by the tests below; `pytest -m slow tests/run/test_device_groups.py`), and the
refusals and the default mesh on 8 devices, in the default suite."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from trace_jax.rl.config import RLConfig
from trace_jax.run import async_rollouts
from trace_jax.run.trainer import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """What device_groups_runs.py's runs did (see there)."""
  root = tmp_path_factory.mktemp("device_groups")
  out = root / "out.json"
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run(
    [sys.executable, os.path.join(HERE, "device_groups_runs.py"), str(out), str(root)],
    capture_output=True,
    text=True,
    env=env,
    timeout=900,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.mark.slow
def test_k0_with_groups_is_the_synchronous_loop(runs):
  """k = 0 with rollouts on devices 0-3 and the learner's (4, 1, 1) mesh on 4-7 equals the
  synchronous loop on one (4, 1, 1) mesh (devices 0-3 for both) bit for bit: every metric
  but timing and the async/* bookkeeping, and the final parameters. No thread ran: each
  batch was generated at the learner's call, with the weights the last update published."""
  k0 = runs["k0"]
  assert len(k0["sync"]) == 2 and k0["groups"] == k0["sync"]
  assert k0["same_params"]
  assert not k0["worker_thread"]
  assert [m["async/version_gap"] for m in k0["groups_async"]] == [0, 0]
  assert [m["async/rollout_version"] for m in k0["groups_async"]] == [0, 1]
  assert all(m["async/rollout_devices"] == "0,1,2,3" for m in k0["groups_async"])
  assert all(m["async/learner_devices"] == "4,5,6,7" for m in k0["groups_async"])


@pytest.mark.slow
def test_resume_mid_pipeline_with_groups_continues_exactly(runs):
  """k = 2, a checkpoint at step 2 (batches 2 and 3 in flight): the resumed run refills both
  rings (the learner's masters and the rollout group's published weights) with versions
  0 .. 2 and ends with the uninterrupted run's metrics and parameters bit for bit."""
  resume = runs["resume"]
  assert resume["restored_versions"] == [[0, 1, 2], [0, 1, 2]]
  assert resume["steps"] == [1, 2, 3, 4]
  assert resume["gaps"] == resume["straight_gaps"] == [0, 1, 2, 2]
  assert resume["same_metrics"] and resume["same_params"]


@pytest.mark.slow
@pytest.mark.parametrize("side", ["rollout", "learner", "hung"])
def test_a_failing_side_stops_the_run_in_one_line(runs, side):
  """A rollout worker that raises (batch 2), a learner update that raises (step 2), and a
  rollout worker that hangs past RLConfig.rollout_timeout (2 s): each run stops, within
  seconds, after the steps before it were logged, with one line naming the side; no
  rollout thread is left."""
  failure = runs["failures"][side]
  assert failure["ended"]  # within the run's join timeout: no rollout thread hangs on
  assert failure["workers_alive"] == 0
  error = failure["error"]
  if side == "rollout":
    assert error["type"] == "RolloutWorkerError"
    assert (
      error["message"] == "rollout worker failed generating batch 2: OSError: rollout host lost"
    )
    assert error["cause"] == "OSError: rollout host lost"
    assert failure["steps"] == [1, 2]
  elif side == "learner":
    assert error == {"type": "OSError", "message": "learner device lost", "cause": None}
    assert failure["log"] == [
      "learner (devices 4,5,6,7) failed at step 2: OSError: learner device lost; "
      "the rollout worker stops"
    ]
    assert failure["steps"] == [1]
  else:
    assert error["type"] == "TimeoutError"
    assert error["message"] == "rollout worker: no batch for step 2 within 2 s; the run stops"
    assert failure["steps"] == [1]
  assert "\n" not in error["message"]


@pytest.mark.slow
def test_the_queue_never_holds_more_than_its_bound(runs):
  """k = 2 with a slowed learner: the queue fills to k + 1 = 3 batches and never past; the
  batches generated but not received (the one generating included) never exceed k + 1."""
  q = runs["queue"]
  assert q["bound"] == 3
  assert max(q["depths"]) == 3 and all(1 <= d <= 3 for d in q["depths"])
  assert max(q["in_flight"]) == 3 and all(1 <= n <= 3 for n in q["in_flight"])


@pytest.mark.slow
def test_rollout_and_learner_arrays_never_share_a_device(runs):
  """The policy, Adam's moments, the master ring and every batch the learner trained on
  lie on devices 4-7; the published ring (the last k + 1 = 3 versions), the engine's
  weights and every batch as generated on devices 0-3. Every step logged both groups'
  ids and a publish time."""
  d = runs["devices"]
  rollout, learner = d["rollout_group"], d["learner_group"]
  assert rollout == [0, 1, 2, 3] and learner == [4, 5, 6, 7]
  for name in ("policy", "opt", "master_ring", "seen_by_learner"):
    assert d[name] == learner, name
  for name in ("rollout_ring", "engine", "seen_by_rollout"):
    assert d[name] == rollout, name
  assert d["rollout_ring_versions"] == [2, 3, 4]
  assert d["logged"] == [["0,1,2,3", "4,5,6,7"]] * 4
  assert all(s > 0 and math.isfinite(s) for s in d["publish_seconds"])
  # the version split read the learner's master ring: at gap 0 the two forwards' weights are
  # the same (0 exactly), at gaps 1, 2, 2 not
  assert d["version_k3"][0] == 0.0 and all(k > 0 for k in d["version_k3"][1:])


DEFAULT_MESH_ON_EIGHT = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + os.environ.get("XLA_FLAGS", "")
import jax
from trace_jax.model.sharding import make_mesh
from trace_jax.rl.config import RLConfig
from trace_jax.run import async_rollouts, rundir
config = RLConfig.from_flat(preset="tiny", task="arith", rollout_devices=2, prompts_per_step=3, group_size=4)
resolved = rundir.on_devices(config, sys.argv[1])  # as the Trainer starts
rollout, learner = async_rollouts.device_groups(resolved)
mesh = make_mesh(*resolved.mesh, devices=learner)
print(json.dumps(dict(devices=jax.device_count(), spec=list(config.mesh), mesh=list(resolved.mesh),
  rollout=[d.id for d in rollout], learner=[d.id for d in mesh.devices.flat])))
"""


def test_on_eight_devices_the_default_mesh_gives_the_learner_the_six_left(tmp_path):
  """8 CPU devices (a subprocess, ~5 s), --rollout_devices=2 and the default --mesh: the
  learner's mesh is (6, 1, 1) on devices 2-7, the rollouts on 0-1; none stays idle."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run(
    [sys.executable, "-c", DEFAULT_MESH_ON_EIGHT, str(tmp_path / "run")],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert json.loads(result.stdout.splitlines()[-1]) == {
    "devices": 8,
    "spec": [-1, 1, 1],
    "mesh": [6, 1, 1],
    "rollout": [0, 1],
    "learner": [2, 3, 4, 5, 6, 7],
  }


def _config(**overrides):
  base = dict(task="arith", preset="tiny", steps=1, prompts_per_step=2, group_size=4)
  return RLConfig.from_flat(**{**base, **overrides})


@pytest.mark.parametrize(
  "value, match",
  [
    (-1, r"RLConfig.rollout_devices=-1 must be an integer >= 0"),
    (True, r"RLConfig.rollout_devices=True must be an integer >= 0"),
    (3, r"RLConfig.rollout_devices=3: the rollout replicas split the batch 8"),
  ],
)
def test_bad_rollout_devices_are_refused_by_the_config(value, match):
  with pytest.raises(ValueError, match=match):
    _config(rollout_devices=value)


def test_rollout_devices_that_leave_the_learner_too_few_are_refused_before_any_work(tmp_path):
  """On this process's devices: all of them for rollouts leaves the learner none; the
  refusal names the field, the value and what is allowed, and no workdir is made."""
  n = jax.device_count()
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=rf"RLConfig.rollout_devices={n} leaves the learner 0 "):
    Trainer(_config(rollout_devices=n), str(workdir), progress=False)
  assert not workdir.exists()
  wide = _config(rollout_devices=1, mesh=(n, 1, 1), prompts_per_step=n, group_size=8)
  with pytest.raises(ValueError, match=r"allowed: rollout_devices none but 0"):
    async_rollouts.device_groups(wide)
  assert async_rollouts.device_groups(_config()) is None


def _fake_processes(monkeypatch, per_process: int, processes: int):
  """jax.devices() of `processes` processes with `per_process` devices each (ids in the
  order CPU multi-process gives: process p's from p * 2048)."""
  import types

  devices = [
    types.SimpleNamespace(id=p * 2048 + i, process_index=p)
    for p in range(processes)
    for i in range(per_process)
  ]
  monkeypatch.setattr(jax, "devices", lambda: devices)
  monkeypatch.setattr(jax, "process_count", lambda: processes)
  return devices


def test_across_processes_groups_must_be_whole_processes(monkeypatch):
  """2 processes of 4 devices: 4 rollout devices and a (4, 1, 1) learner mesh are process 0's
  and process 1's; 2 rollout devices (process 0's split between the groups) or a learner
  mesh of 2 (process 1's partly in neither) are refused, naming the process."""
  devices = _fake_processes(monkeypatch, 4, 2)
  rollout, learner = async_rollouts.device_groups(_config(rollout_devices=4, mesh=(4, 1, 1)))
  assert rollout == devices[:4] and learner == devices[4:]
  assert async_rollouts.learner_process((rollout, learner)) == 1
  with pytest.raises(ValueError, match=r"puts process 0's devices \[0, 1, 2, 3\] in both"):
    async_rollouts.device_groups(_config(rollout_devices=2, mesh=(4, 1, 1)))
  with pytest.raises(ValueError, match=r"puts process 1's devices \[2048, 2049, 2050, 2051\]"):
    async_rollouts.device_groups(_config(rollout_devices=4, mesh=(2, 1, 1)))


def test_across_processes_each_group_is_one_process(monkeypatch):
  """4 processes of 2 devices: rollout devices 0-3 (processes 0 and 1) and a (4, 1, 1)
  learner mesh (processes 2 and 3) cover every process whole, but each group would span two
  processes, whose batches and weights are one process's messages: refused, naming both
  groups' processes; one process each (2 + 2 devices) leaves processes 2 and 3 out."""
  _fake_processes(monkeypatch, 2, 4)
  with pytest.raises(
    ValueError, match=r"rollout and the learner group processes \[0, 1\] and \[2, 3\]"
  ):
    async_rollouts.device_groups(_config(rollout_devices=4, mesh=(4, 1, 1)))
  with pytest.raises(
    ValueError, match=r"puts process 2's devices \[4096, 4097\] in both groups or partly in neither"
  ):
    async_rollouts.device_groups(_config(rollout_devices=2, mesh=(2, 1, 1)))


def test_across_processes_staleness_needs_device_groups(monkeypatch):
  """Several processes: max_staleness > 0 with rollouts on the learner's devices is refused by
  name (use --rollout_devices); with device groups it is allowed; so is k = 0 without."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"RLConfig.max_staleness=2 with rollouts on the learner"):
    async_rollouts.check_staleness(_config(max_staleness=2))
  assert async_rollouts.check_staleness(_config(max_staleness=2, rollout_devices=4)) == 2
  assert async_rollouts.check_staleness(_config()) == 0


def test_across_processes_refuses_checkpoints_and_warm_starts(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"RLConfig.checkpoint_every=5 .* allowed: checkpoint_every"):
    async_rollouts.check_across_processes(_config(rollout_devices=4, checkpoint_every=5), False)
  with pytest.raises(ValueError, match=r"RLConfig.sft_warm_start=True .* allowed: sft_warm_start"):
    cfg = _config(rollout_devices=4, checkpoint_every=0, sft_warm_start=True)
    async_rollouts.check_across_processes(cfg, True)
  async_rollouts.check_across_processes(_config(rollout_devices=4, checkpoint_every=0), False)
