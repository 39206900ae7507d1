"""Files written whole or not at all."""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any


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


def write_atomic(path: str, data: bytes | str) -> None:
  """Write to a temporary file in the same directory, then rename it into place."""
  path = os.path.abspath(path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_json(path: str, obj: Any) -> None:
  write_atomic(path, json.dumps(_clean(obj), indent=2, allow_nan=False) + "\n")
