"""Fault injection shared by the reliability tests."""

import contextlib
import errno
import os
import subprocess


@contextlib.contextmanager
def full_filesystem(path, size_kib: int = 256):
  """A tiny tmpfs mounted at `path` (a directory) if this machine lets us mount one (and
  RELIABILITY_NO_MOUNT is unset: it tests the fallback). Yields True when mounted; the
  tests inject ENOSPC at the write otherwise."""
  os.makedirs(path, exist_ok=True)
  if os.environ.get("RELIABILITY_NO_MOUNT"):
    yield False
    return
  try:
    mounted = (
      subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
        capture_output=True,
        timeout=30,
      ).returncode
      == 0
    )
  except (OSError, subprocess.SubprocessError):
    mounted = False
  try:
    yield mounted
  finally:
    if mounted:
      subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill(path, leave_bytes: int = 0) -> None:
  """Fill the filesystem holding directory `path` up to `leave_bytes` free."""
  with open(os.path.join(path, "filler"), "wb") as f:
    try:
      while True:
        stat = os.statvfs(path)
        free = stat.f_bavail * stat.f_frsize
        if free <= leave_bytes:
          break
        f.write(b"\0" * min(free - leave_bytes, 1 << 16))
        f.flush()
    except OSError as e:
      assert e.errno == errno.ENOSPC, e
