"""One run per workdir: a second run on a busy workdir is refused with one line
naming the holder and writes nothing; a lock left by a dead process is taken over (and said);
released at exit and when a start fails; one process shares its lock; a multi-host job takes
it on process 0 only. The holder is a small helper process, not a training run."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.run.checkpoint import Checkpoints
from trace_jax.rl.config import RLConfig
from trace_jax.run.trainer import Trainer
from trace_jax.utils import lock as lock_lib
from trace_jax.utils.lock import LOCK_FILE, WorkdirBusy, WorkdirLock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The lock module needs only the standard library: loaded by its path, the helper starts in
# a blink (importing the package would import JAX).
HOLDER = textwrap.dedent("""
    import importlib.util, os, signal, sys
    spec = importlib.util.spec_from_file_location("lock", sys.argv[3])
    lock_lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock_lib)
    lock = lock_lib.WorkdirLock.acquire(sys.argv[1])
    print("held", flush=True)
    sys.stdin.readline()  # hold it until told
    if sys.argv[2] == "release":
      lock.release()
    elif sys.argv[2] == "kill":  # dies holding it: no release, the file stays
      os.kill(os.getpid(), signal.SIGKILL)
    # "exit": a normal exit without release(); the lock is released at exit
""")


@contextlib.contextmanager
def held(workdir, then="release"):
  """A helper process holding `workdir`'s lock; on leaving, it does `then` and ends."""
  process = subprocess.Popen(
    [sys.executable, "-c", HOLDER, str(workdir), then, lock_lib.__file__],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    assert process.stdout.readline().strip() == "held", process.stderr.read()
    yield process
  finally:
    process.communicate("go\n", timeout=60)


def _snapshot(folder):
  """Every file and folder under `folder`: bytes and mtime."""
  out = {}
  for directory, dirs, files in os.walk(folder):
    for name in dirs + files:
      path = os.path.join(directory, name)
      stat = os.stat(path)
      data = None if os.path.isdir(path) else open(path, "rb").read()
      out[os.path.relpath(path, folder)] = (stat.st_mtime_ns, data)
  return out


def _busy_line(workdir, pid) -> str:
  host = re.escape(socket.gethostname())
  return (
    rf"workdir {re.escape(str(workdir))} is in use by pid {pid} on host {host} since "
    rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d \S*; wait for it to end, stop it, or use another "
    rf"--workdir"
  )


def test_a_second_run_on_a_busy_workdir_is_refused_and_touches_nothing(tmp_path):
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "2").mkdir(parents=True)
  (workdir / "checkpoints" / "2" / "state").write_bytes(np.random.default_rng(0).bytes(64))
  (workdir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(3)))
  with held(workdir) as holder:
    before = _snapshot(workdir)
    record = json.loads((workdir / LOCK_FILE).read_text())
    assert (record["pid"], record["host"]) == (holder.pid, socket.gethostname())
    second = subprocess.run(  # the whole script, as a double submit runs it
      [
        sys.executable,
        os.path.join(ROOT, "experiments", "rl.py"),
        f"--workdir={workdir}",
        "--preset=tiny",
        "--sft_steps=0",
        "--eval_every=0",
        "--steps=1",
      ],
      capture_output=True,
      text=True,
      timeout=600,
      env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert second.returncode == 1, second.stderr[-3000:]
    errors = [line for line in second.stderr.splitlines() if line.startswith("rl.py: error: ")]
    assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert re.fullmatch("rl.py: error: " + _busy_line(workdir, holder.pid), errors[0]), errors
    with pytest.raises(WorkdirBusy, match=_busy_line(workdir, holder.pid)):
      WorkdirLock.acquire(str(workdir))  # the same in-process
    assert lock_lib.current_holder(str(workdir))["pid"] == holder.pid  # (export's read)
    assert _snapshot(workdir) == before  # the first run's files, the lock file included
  assert not (workdir / LOCK_FILE).exists()  # released: deleted
  assert lock_lib.current_holder(str(workdir)) is None
  with WorkdirLock.acquire(str(workdir)):
    assert json.loads((workdir / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, caplog):
  workdir = tmp_path / "run"
  with held(workdir, then="kill") as holder:
    pass
  assert holder.returncode == -signal.SIGKILL
  left = json.loads((workdir / LOCK_FILE).read_text())
  assert left["pid"] == holder.pid and lock_lib.holder_alive(left) is False
  assert lock_lib.current_holder(str(workdir)) is None  # the kernel dropped its flock
  lock = WorkdirLock.acquire(str(workdir))
  assert (
    f"workdir {workdir}: taking over the lock left by pid {holder.pid} on host "
    f"{socket.gethostname()} since {left['since']}, which ended without releasing it "
    f"(no longer running)" in caplog.text
  )
  assert json.loads((workdir / LOCK_FILE).read_text())["pid"] == os.getpid()
  lock.release()
  assert not (workdir / LOCK_FILE).exists()


def test_released_at_exit_and_when_a_start_fails(tmp_path, caplog):
  workdir = tmp_path / "run"
  with held(workdir, then="exit"):
    assert (workdir / LOCK_FILE).exists()
  assert not (workdir / LOCK_FILE).exists()  # released by the exit, no record left behind
  # A Trainer that refuses to start (the workdir holds another config's checkpoint) has
  # taken the lock first; it releases it on the way out.
  Checkpoints(str(workdir / "checkpoints")).save(
    1,
    {"x": jnp.arange(4.0)},
    {"step": 1, "config": RLConfig.from_flat(preset="tiny", seed=5).to_dict()},
  )
  with pytest.raises(ValueError, match=r"different config; fields that differ: \['seed'\]"):
    Trainer(RLConfig.from_flat(preset="tiny", seed=0), str(workdir), progress=False)
  assert not (workdir / LOCK_FILE).exists()
  with WorkdirLock.acquire(str(workdir)):
    pass
  assert "taking over" not in caplog.text


def test_one_process_shares_its_lock(tmp_path):
  first = WorkdirLock.acquire(str(tmp_path))
  second = WorkdirLock.acquire(str(tmp_path))  # e.g. a Trainer resuming in the same process
  first.release()
  first.release()  # idempotent
  assert (tmp_path / LOCK_FILE).exists()
  second.release()
  assert not (tmp_path / LOCK_FILE).exists()


def test_holder_alive_tells_a_live_holder_from_a_dead_or_reused_pid():
  me = lock_lib._me()
  assert lock_lib.holder_alive(me) is True
  reused = dict(me, proc_start=str(int(me["proc_start"]) + 1))  # same pid, a later process
  assert lock_lib.holder_alive(reused) is False
  ended = subprocess.run(
    [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
  )
  assert lock_lib.holder_alive(dict(me, pid=int(ended.stdout), proc_start=None)) is False
  assert lock_lib.holder_alive(dict(me, host=me["host"] + "-elsewhere")) is None  # unknown


def test_a_multi_host_job_locks_on_process_0_only(tmp_path, monkeypatch):
  from jax.experimental import multihost_utils

  told = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(
    multihost_utils, "broadcast_one_to_all", lambda x: told.append(int(x)) or np.int32(ok[0])
  )
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  ok = [1]  # process 0 got it: the others go on, without a lock of their own
  assert lock_lib.lock_run_workdir(str(tmp_path)) is None
  assert not (tmp_path / LOCK_FILE).exists()
  ok = [0]  # process 0 was refused: every process stops
  with pytest.raises(WorkdirBusy, match="could not be locked by process 0 of this job"):
    lock_lib.lock_run_workdir(str(tmp_path))
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  ok = [1]
  lock = lock_lib.lock_run_workdir(str(tmp_path))
  assert told[-1] == 1 and (tmp_path / LOCK_FILE).exists()  # told the others it got it
  lock.release()


# Runs that start in the same instant on a filesystem without flock (flock patched to
# answer "not supported", as ENOLCK does): the holder record decides, and exactly one wins.
RACER = textwrap.dedent("""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("lock", sys.argv[3])
    lock_lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock_lib)
    lock_lib._try_flock = lambda fd: None  # this filesystem has no flock
    time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all start together
    try:
      lock_lib.WorkdirLock.acquire(sys.argv[1])
      print("won", flush=True)
      time.sleep(1.0)  # held while the others try
    except lock_lib.WorkdirBusy as e:
      print("busy", e, flush=True)
""")


@pytest.mark.parametrize("trial", range(4))
def test_without_flock_exactly_one_of_simultaneous_starts_wins(tmp_path, trial):
  import time

  workdir = tmp_path / f"race{trial}"
  start = time.time() + 1.5  # after every racer's interpreter is up
  racers = [
    subprocess.Popen(
      [sys.executable, "-c", RACER, str(workdir), str(start), lock_lib.__file__],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for _ in range(6)
  ]
  outputs = [racer.communicate(timeout=60) for racer in racers]
  said = [out.split(" ", 1)[0].strip() for out, _ in outputs]
  assert said.count("won") == 1, (said, [err for _, err in outputs])
  assert said.count("busy") == 5
  assert not [p for p in os.listdir(workdir) if p.endswith(".tmp")]  # no staged records left


def test_without_flock_a_dead_holders_record_is_taken_over(tmp_path, monkeypatch):
  monkeypatch.setattr(lock_lib, "_try_flock", lambda fd: None)
  workdir = tmp_path / "w"
  workdir.mkdir()
  dead = {"host": socket.gethostname(), "pid": 2**22 + 12345, "since": "then"}
  (workdir / LOCK_FILE).write_text(json.dumps(dead))
  lock = WorkdirLock.acquire(str(workdir))
  try:
    record = json.loads((workdir / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid()
  finally:
    lock.release()
  assert not (workdir / LOCK_FILE).exists()
