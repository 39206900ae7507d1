"""One run per workdir: a lock file that names its holder.

Two runs in one workdir (a double submit, a scheduler requeue while the old job still runs)
interleave their metrics lines and overwrite each other's checkpoints. A run therefore takes
`<workdir>/run.lock` before it writes anything there, and a second run is refused with one
line naming the holder.

- The lock is `fcntl.flock` on that file. The kernel drops it when the holding process ends,
  however it ends (SIGKILL included), so a dead run never blocks a new one, whatever became
  of its pid since (reused or not).
- The file holds the holder's host, pid, process start time and when it took the lock: the
  refusal names them, and a file still there when the lock is free was left by a holder that
  died without releasing it; the new run says so (stderr) and takes over.
- Released (the file deleted, while still locked) by `release`, which the Trainer calls on
  `close` or when it is garbage collected, and at interpreter exit.
- Within one process the lock is shared: a second Trainer on the same workdir in the same
  process (a test resuming a run, compare_arms reading a finished cell) is not a second run.
- A multi-host job is one run: process 0 takes the lock for all (`lock_run_workdir`); the
  others learn by a broadcast whether it did, so the whole job stops on a busy workdir.
- On a filesystem without flock (ENOLCK / EOPNOTSUPP: some NFS or Lustre mounts) the file's
  own record decides, and the record is made whole before it is published: written to a
  file of its own, then linked to the lock file's name (`link()` fails where the name
  exists), so of runs starting together exactly one wins. An existing record of a live
  holder on this host, or of any holder on another (which cannot be checked from here),
  refuses; one of a dead holder on this host (or an empty file) is removed, after it is read
  again to be sure it is still the same, and the link is tried again.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_BUSY_RETRY_S = 1.0  # a busy lock is retried this long (a reader's probe holds it briefly)


class WorkdirBusy(ValueError):
  """The workdir is held by another live run; the message names it in one line."""


def _proc_start(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (/proc/PID/stat field 22), which
  tells a live process from a later one that got the same pid; None off Linux."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _boot_id() -> str | None:
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return None


def _me() -> dict:
  return {
    "host": socket.gethostname(),
    "pid": os.getpid(),
    "since": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
    "proc_start": _proc_start(os.getpid()),
    "boot_id": _boot_id(),
    "command": " ".join(sys.argv)[:200],
  }


def _read_holder(fd: int) -> dict | None:
  """The holder record in the lock file (None: empty or unreadable)."""
  try:
    raw = os.pread(fd, 4096, 0)
    holder = json.loads(raw) if raw.strip() else None
  except (OSError, ValueError):
    return None
  return holder if isinstance(holder, dict) and "pid" in holder else None


def holder_alive(holder: dict) -> bool | None:
  """Whether the recorded holder still runs: None when it is on another host (unknown)."""
  if holder.get("host") != socket.gethostname():
    return None
  if holder.get("boot_id") and _boot_id() and holder["boot_id"] != _boot_id():
    return False  # the machine rebooted since
  pid = int(holder["pid"])
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # alive, another user's
  start = _proc_start(pid)
  return not (holder.get("proc_start") and start and start != holder["proc_start"])


def describe(holder: dict | None) -> str:
  if holder is None:
    return "another process (its lock file holds no record)"
  return f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"


# Locks this process holds: lock-file path -> [fd, count] (shared by the process's holders).
_HELD: dict[str, list] = {}
_MUTEX = threading.Lock()


class WorkdirLock:
  """This process's hold on a workdir (`WorkdirLock.acquire`); `release` is idempotent."""

  def __init__(self, path: str):
    self.path = path  # the lock file
    self.released = False

  @classmethod
  def acquire(cls, workdir: str) -> "WorkdirLock":
    """Take the lock of `workdir` (created if absent), before anything is written there.

    Raises:
      WorkdirBusy: another live run holds it (one line: the workdir and the holder).
      ValueError: the workdir cannot be created or written.
    """
    workdir = os.path.abspath(workdir)
    path = os.path.join(workdir, LOCK_FILE)
    with _MUTEX:
      held = _HELD.get(path)
      if held is not None:
        held[1] += 1
        return cls(path)
      try:
        os.makedirs(workdir, exist_ok=True)
        fd = _lock_file(workdir, path)
      except OSError as e:
        raise ValueError(f"workdir {workdir!r} is not writable: {e}") from e
      _HELD[path] = [fd, 1]
    return cls(path)

  def release(self) -> None:
    """Give up this hold; the last one in the process deletes the file and unlocks."""
    with _MUTEX:
      if self.released:
        return
      self.released = True
      held = _HELD.get(self.path)
      if held is None:
        return
      held[1] -= 1
      if held[1] > 0:
        return
      del _HELD[self.path]
      try:
        os.unlink(self.path)  # while still locked: no one can have taken it meanwhile
      except OSError:
        pass
      os.close(held[0])  # unlocks

  def __enter__(self) -> "WorkdirLock":
    return self

  def __exit__(self, *exc) -> None:
    self.release()


@atexit.register
def _release_all() -> None:
  """At exit, release what is still held (the kernel would unlock it, but the file and its
  record would stay, to be reported as left by a dead run)."""
  for path in list(_HELD):
    _HELD[path][1] = 1
    WorkdirLock(path).release()


def _try_flock(fd: int) -> bool | None:
  """True: locked; False: another holder has it; None: this filesystem has no flock."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except BlockingIOError:
    return False
  except OSError as e:
    if e.errno in _NO_FLOCK:
      return None
    raise


def _lock_file(workdir: str, path: str) -> int:
  """Open, lock and stamp the lock file; the fd that holds the lock."""
  if not _has_flock(workdir):
    return _link_record(workdir, path)
  deadline = time.monotonic() + _BUSY_RETRY_S
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      got = _try_flock(fd)
      while got is False and time.monotonic() < deadline:
        time.sleep(0.05)
        got = _try_flock(fd)
      previous = _read_holder(fd)
      if got is False:
        raise WorkdirBusy(_busy(workdir, previous))
      if os.fstat(fd).st_ino != _inode(path):
        os.close(fd)  # its holder deleted the file as we locked it: lock the new one
        continue
      _say_taken_over(workdir, previous)
      record = json.dumps(_me()).encode()
      os.ftruncate(fd, 0)
      os.pwrite(fd, record, 0)
      os.fsync(fd)
      return fd
    except BaseException:
      _close_quietly(fd)
      raise


def _has_flock(workdir: str) -> bool:
  """Whether the workdir's filesystem has flock (probed on the directory, which creates no
  file: without flock the lock file's name is published only by `link`)."""
  fd = os.open(workdir, os.O_RDONLY)
  try:
    got = _try_flock(fd)
    if got:
      fcntl.flock(fd, fcntl.LOCK_UN)
    return got is not None
  finally:
    os.close(fd)


def _close_quietly(fd: int) -> None:
  try:
    os.close(fd)
  except OSError:
    pass


def _say_taken_over(workdir: str, previous: dict | None) -> None:
  if previous is not None:
    log.warning(
      "workdir %s: taking over the lock left by %s, which ended without releasing it (%s)",
      workdir,
      describe(previous),
      "no longer running" if holder_alive(previous) is False else "lock not held",
    )


def _read_record(path: str) -> tuple[dict | None, bytes | None]:
  """The holder record at `path` and its raw bytes ((None, None): no file)."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    return None, None
  try:
    raw = os.pread(fd, 4096, 0)
    return _read_holder(fd), raw
  finally:
    os.close(fd)


def _link_record(workdir: str, path: str) -> int:
  """Without flock: publish this process's record at `path` by `link()`, which exactly one
  of several runs starting together wins; the fd of the published file."""
  record = json.dumps(_me()).encode()
  staged = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
  fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
  try:
    os.write(fd, record)
    os.fsync(fd)
    while True:
      try:
        os.link(staged, path)
        return fd
      except FileExistsError:
        pass
      previous, raw = _read_record(path)
      if raw is None:
        continue  # removed meanwhile: try again
      if previous is not None and holder_alive(previous) is not False:
        raise WorkdirBusy(_busy(workdir, previous, no_flock=True))
      # A dead holder's record (or an empty file): remove it if it is still the same file.
      again, raw_again = _read_record(path)
      if raw_again != raw:
        continue
      try:
        os.unlink(path)
      except FileNotFoundError:
        pass
      _say_taken_over(workdir, previous)
  except BaseException:
    os.close(fd)
    raise
  finally:
    try:
      os.unlink(staged)  # the published name holds the record (or another run's)
    except OSError:
      pass


def _inode(path: str) -> int | None:
  try:
    return os.stat(path).st_ino
  except FileNotFoundError:
    return None


def _busy(workdir: str, holder: dict | None, no_flock: bool = False) -> str:
  where = os.path.join(workdir, LOCK_FILE)
  hint = "wait for it to end, stop it, or use another --workdir"
  if no_flock and holder is not None and holder_alive(holder) is None:
    hint += f" (this filesystem has no flock: if that run has ended, delete {where})"
  return f"workdir {workdir} is in use by {describe(holder)}; {hint}"


def current_holder(workdir: str) -> dict | None:
  """The record of another live run holding `workdir`'s lock, or None (also when this
  process holds it); writes nothing (the file is opened read-only and probed with a shared
  lock for an instant)."""
  path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
  if path in _HELD:
    return None
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return None
  try:
    record = _read_holder(fd)
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
      return record or {}
    except OSError:  # no flock here: the record decides
      return record if record is not None and holder_alive(record) is not False else None
    return None
  finally:
    os.close(fd)  # (drops the shared lock)


def lock_run_workdir(workdir: str) -> WorkdirLock | None:
  """The lock of a run's workdir: taken by process 0 for the whole job (None elsewhere). In
  a multi-host job every process learns whether process 0 got it, so all stop together.

  Raises:
    WorkdirBusy / ValueError: as `WorkdirLock.acquire` (on every process of the job).
  """
  import jax  # (only here: the lock itself needs no JAX)

  if jax.process_count() == 1:
    return WorkdirLock.acquire(workdir)
  import numpy as np
  from jax.experimental import multihost_utils

  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = WorkdirLock.acquire(workdir)
    except Exception as e:  # noqa: BLE001 - told to the other processes, then raised
      error = e
  ok = int(multihost_utils.broadcast_one_to_all(np.int32(lock is not None)))
  if error is not None:
    raise error
  if not ok:
    raise WorkdirBusy(
      f"workdir {os.path.abspath(workdir)} could not be locked by process 0 of this job "
      f"(its error names the holder)"
    )
  return lock
