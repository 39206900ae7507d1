"""Files written whole or not at all, and JSON-lines logs that survive a torn append.

A crash or a full disk can stop a write at any byte. Whole files are written to a temporary
file, fsynced and renamed into place, so a reader sees the old file or the new one. A rename
is an update of the directory, which the kernel may still hold in memory when the power
goes: every rename that publishes a file or folder is followed by an fsync of its directory
(`fsync_directory`), or the new file can vanish (or the old one return) after a power loss.
Folders are published the same way (`atomic_directory`); a staging folder that a killed
writer left behind carries its pid, and the next writer to the same folder removes it. Files
written whole get the mode a plain `open` would give them (0666 less the umask). An
append-only log (metrics.jsonl)
cannot be renamed on every line; instead each line is fsynced, and the reader drops a torn
last line (an append that never finished) and says so, while a damaged line anywhere else is
an error naming the file and the line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import uuid
from typing import Any, Iterable, Iterator

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
  """JSON has no NaN / Inf: write them as null."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {str(k): _clean(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_clean(v) for v in value]
  if hasattr(value, "item") and getattr(value, "shape", None) == ():
    return _clean(value.item())
  return value


def _with_path(error: OSError, path: str, action: str) -> OSError:
  """The same OSError (errno kept) with the path and the action in its message."""
  return type(error)(error.errno, f"could not {action} {path}: {error.strerror or error}")


# fsync of a directory is refused by some filesystems (and by Windows, which has no
# O_DIRECTORY); there the rename is as durable as the filesystem makes it, nothing to add.
_NO_DIRECTORY_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EISDIR, errno.EACCES)


def fsync_directory(path: str) -> None:
  """fsync the directory `path`, so that the renames and creations in it survive a power
  loss (a rename is durable only once its directory is).

  Raises:
    OSError: naming `path`, except where the filesystem does not fsync directories.
  """
  flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
  try:
    fd = os.open(path, flags)
  except OSError as e:
    if e.errno in _NO_DIRECTORY_FSYNC:
      return
    raise _with_path(e, path, "open the directory") from e
  try:
    os.fsync(fd)
  except OSError as e:
    if e.errno not in _NO_DIRECTORY_FSYNC:
      raise _with_path(e, path, "fsync the directory") from e
  finally:
    os.close(fd)


def publish(tmp: str, path: str) -> None:
  """Rename `tmp` over `path` (same directory) and fsync that directory: the one way a
  finished file is put in place."""
  os.replace(tmp, path)
  fsync_directory(os.path.dirname(os.path.abspath(path)))


def write_atomic(path: str, data: bytes | str | Iterable[bytes]) -> None:
  """Write to a temporary file in the same directory, fsync it, rename it into place and
  fsync the directory. `data` may be an iterable of byte chunks, written one by one as it
  yields them (a file larger than memory).

  Raises:
    OSError: naming `path` (e.g. a full disk); the previous file, if any, is untouched.
  """
  path = os.path.abspath(path)
  tmp = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Created with 0666 (the kernel applies the umask), as `open` would; mkstemp's 0600
    # would make written files private while copied ones are not.
    candidate = os.path.join(
      os.path.dirname(path), f".{os.path.basename(path)[:200]}.{uuid.uuid4().hex[:12]}.tmp"
    )
    fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    tmp = candidate
    with os.fdopen(fd, "wb") as f:
      if isinstance(data, (bytes, bytearray, memoryview, str)):
        data = [data]
      for chunk in data:
        f.write(chunk.encode() if isinstance(chunk, str) else chunk)
        del chunk  # (before the next chunk is made: one held at a time)
      f.flush()
      os.fsync(f.fileno())
    publish(tmp, path)
  except OSError as e:
    raise _with_path(e, path, "write") from e
  finally:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)


def write_json(path: str, obj: Any) -> None:
  write_atomic(path, json.dumps(_clean(obj), indent=2, allow_nan=False) + "\n")


def _fsync_tree(root: str) -> None:
  """fsync every file and folder under `root` (files copied in, e.g. by shutil, are not)."""
  for folder, _, files in os.walk(root, topdown=False):
    for name in files:
      fd = os.open(os.path.join(folder, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    fsync_directory(folder)


def _host_tag() -> str:
  """8 hex digits naming this host, so that a writer on another host sharing the folder
  (its pids are not ours to check) never has its staging folder removed from here."""
  return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # alive, another user's
  return True


def _remove_stale(parent: str, name: str) -> None:
  """Remove what writers of `<parent>/<name>` that died on this host left beside it: their
  staging folders (`.<name>.tmp-<pid>-...`), and their set-aside old folders
  (`.<name>.old-<pid>-...`) once `name` itself is in place. A live writer's folders (its pid
  runs), and those of other hosts, are left alone."""
  pattern = re.compile(rf"\.{re.escape(name)}\.(tmp|old)-(\d+)-({_host_tag()})-[0-9a-f]{{12}}")
  published = os.path.isdir(os.path.join(parent, name))
  for entry in sorted(os.listdir(parent)):
    match = pattern.fullmatch(entry)
    if match is None or _pid_alive(int(match[2])):
      continue
    if match[1] == "old" and not published:
      continue  # a crash between the two renames: the old folder is the one there is
    log.warning(
      "removing %s, left by a writer of %s that ended before it finished (pid %s)",
      os.path.join(parent, entry),
      name,
      match[2],
    )
    shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def check_replaceable_folder(path: str, label: str | None = None, hint: str = "") -> None:
  """A ValueError, before anything is written, if `path` cannot be replaced whole by a
  rename: it is a symbolic link (the rename would replace the link, not the folder it
  names) or exists and is not a folder. `label` names it in the message (default: the
  path); `hint` is appended to the second refusal."""
  label = label or path
  if os.path.islink(path):
    raise ValueError(
      f"{label} is a symbolic link (to {os.readlink(path)}); a folder replaced whole is "
      f"renamed into place, which would replace the link: give the folder itself, "
      f"{os.path.realpath(path)}"
    )
  if os.path.lexists(path) and not os.path.isdir(path):
    raise ValueError(f"{label} exists and is not a folder{hint}")


def check_writable_folder(folder: str, label: str) -> None:
  """A ValueError, before any work, unless a file can be made and removed in `folder`, or
  in its nearest existing ancestor where it does not exist yet (it would be made there): a
  read-only filesystem or a folder without write permission is found in microseconds, not
  after whatever would have been written there was computed. `label` names what is
  written in the message."""
  nearest = os.path.abspath(folder)
  while not os.path.exists(nearest) and os.path.dirname(nearest) != nearest:
    nearest = os.path.dirname(nearest)
  probe = os.path.join(nearest, f".write_test.{os.getpid()}.{uuid.uuid4().hex[:12]}")
  try:
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.remove(probe)
  except OSError as e:
    raise ValueError(
      f"{label} cannot be written: making a file in {nearest} failed "
      f"({e.strerror or type(e).__name__})"
    ) from e


@contextlib.contextmanager
def atomic_directory(path: str) -> Iterator[str]:
  """Yield a new empty folder beside `path` to fill; when the block ends without an error,
  fsync what it holds and rename it to `path`, replacing an existing folder whole (nothing
  of the old one survives, e.g. a shard an earlier, larger export wrote). On an error the
  new folder is removed and `path` is left as it was.

  A folder cannot be renamed over a non-empty one, so an old `path` is first renamed aside
  (`.<name>.old-*`), then the new one into place, then the old one deleted: a crash between
  the two renames leaves no `path` but both whole folders beside it, never a mixture. Both
  names carry the writer's pid and host; folders of a writer on this host that no longer
  runs (killed mid-write) are removed when the next one starts.

  Raises:
    ValueError: `path` is a symbolic link (the renames would replace the link, not the
      folder it names) or exists and is not a folder; before anything is written.
  """
  path = os.path.abspath(path)
  parent, name = os.path.split(path)
  check_replaceable_folder(path)
  os.makedirs(parent, exist_ok=True)
  _remove_stale(parent, name)
  tag = f"{os.getpid()}-{_host_tag()}"
  staging = os.path.join(parent, f".{name}.tmp-{tag}-{uuid.uuid4().hex[:12]}")
  os.mkdir(staging)  # (mkdtemp's mode is 0700; this one follows the umask like makedirs)
  try:
    yield staging
    _fsync_tree(staging)
    old = None
    if os.path.exists(path):
      old = os.path.join(parent, f".{name}.old-{tag}-{uuid.uuid4().hex[:12]}")
      os.rename(path, old)
    os.rename(staging, path)
    fsync_directory(parent)
    if old is not None:
      shutil.rmtree(old)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def resolve_inside(directory: str, name: str) -> str:
  """The real path of the file `name` of `directory`, refusing one that leads outside it.

  A checkpoint folder's files may be symbolic links. Following one that points elsewhere
  (a key file, /etc/passwd) would read a file that is no part of the checkpoint, and an
  export would publish it. Links that stay inside the folder (its real path) are followed,
  and so are those of the Hugging Face hub cache's own layout: the files of
  `<repo>/snapshots/<revision>/` link to `<repo>/blobs/`.

  Returns:
    The resolved path (which need not exist; the caller checks).

  Raises:
    ValueError: naming the file, where it leads, and the folder it must stay in.
  """
  root = os.path.realpath(directory)
  real = os.path.realpath(os.path.join(root, name))
  allowed = [root]
  snapshots = os.path.dirname(root)
  if os.path.basename(snapshots) == "snapshots":
    allowed.append(os.path.join(os.path.dirname(snapshots), "blobs"))
  for folder in allowed:
    if real != folder and os.path.commonpath([real, folder]) == folder:
      return real
  raise ValueError(
    f"{os.path.join(directory, name)} leads to {real}, outside the checkpoint folder "
    f"{root}; refusing to read it: put the file itself in the folder"
  )


def append_jsonl(path: str, record: dict) -> None:
  """Append one JSON line and fsync it (a crash leaves at most a torn last line).

  Raises:
    OSError: naming `path` (e.g. a full disk).
  """
  try:
    created = not os.path.exists(path)
    with open(path, "a") as f:
      f.write(json.dumps(record) + "\n")
      f.flush()
      os.fsync(f.fileno())
    if created:  # the new name is a directory entry: durable once the directory is
      fsync_directory(os.path.dirname(os.path.abspath(path)))
  except OSError as e:
    raise _with_path(e, path, "append to") from e


def read_json_object(path: str) -> dict:
  """A JSON file holding one object, with errors that name the file (ValueError)."""
  try:
    with open(path) as f:
      value = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from e
  if not isinstance(value, dict):
    raise ValueError(f"{path} is not a JSON object")
  return value


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSON-lines file, dropping (with a warning) a torn last line.

  Raises:
    ValueError: a line other than the last does not parse (naming the file and the line).
  """
  with open(path, "rb") as f:
    raw = f.read()
  lines = raw.decode("utf-8", errors="replace").split("\n")
  records = []
  numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
  for position, (number, line) in enumerate(numbered):
    try:
      record = json.loads(line)
      if not isinstance(record, dict):
        raise json.JSONDecodeError("not a JSON object", line, 0)
      records.append(record)
    except json.JSONDecodeError as e:
      torn = position == len(numbered) - 1 and not raw.endswith(b"\n")
      if torn:
        log.warning(
          "%s: dropped a torn last line %r (line %d), left by an interrupted write",
          path,
          line[:40],
          number,
        )
        break
      raise ValueError(
        f"{path}, line {number}: not valid JSON ({e.msg}: {line[:60]!r}); the "
        f"file is damaged: delete that line (or the file) and rerun"
      ) from e
  return records
