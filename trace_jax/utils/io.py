"""Files written whole or not at all, and JSON-lines logs that survive a torn append.

A crash or a full disk can stop a write at any byte. Whole files are written to a temporary
file, fsynced and renamed into place, so a reader sees the old file or the new one. An
append-only log (metrics.jsonl) cannot be renamed on every line; instead each line is
fsynced, and the reader drops a torn last line (an append that never finished) and says
so, while a damaged line anywhere else is an error naming the file and the line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from typing import Any

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


def write_atomic(path: str, data: bytes | str) -> None:
  """Write to a temporary file in the same directory, fsync it, then rename it into place.

  Raises:
    OSError: naming `path` (e.g. a full disk); the previous file, if any, is untouched.
  """
  path = os.path.abspath(path)
  tmp = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      f.write(data.encode() if isinstance(data, str) else data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError as e:
    raise _with_path(e, path, "write") from e
  finally:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)


def write_json(path: str, obj: Any) -> None:
  write_atomic(path, json.dumps(_clean(obj), indent=2, allow_nan=False) + "\n")


def append_jsonl(path: str, record: dict) -> None:
  """Append one JSON line and fsync it (a crash leaves at most a torn last line).

  Raises:
    OSError: naming `path` (e.g. a full disk).
  """
  try:
    with open(path, "a") as f:
      f.write(json.dumps(record) + "\n")
      f.flush()
      os.fsync(f.fileno())
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
