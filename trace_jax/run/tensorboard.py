"""TensorBoard event files of a run's metrics, kept equal to metrics.jsonl.

  <workdir>/tensorboard/events.out.tfevents.<time>.<host>.history  the config, and the metrics
                                                                   lines there were at the start
  <workdir>/tensorboard/events.out.tfevents.<time>.<host>.live     the lines logged since

Every metrics line becomes one event at its step: each of its JSON numbers (not `step`, not
booleans, strings, None, lists or objects) a scalar under its own key (`rewards/mean`,
`eval/reward_fp4`: TensorBoard groups them by the part before the slash). The config is one
text summary (`config`, at step 0), written once per start.

metrics.jsonl is the record; the event files are rewritten from it on every start:

  1. Remove what an interrupted start left beside tensorboard/ (`.tensorboard.tmp-*`,
     `.tensorboard.old-*`: the workdir's lock makes them no live writer's).
  2. Write the config and every line of metrics.jsonl (as the resume cut it back to the
     checkpoint's steps) into a fresh events file in a staging folder, and put it in place of
     tensorboard/ whole (`utils.io.atomic_directory`: fsync, rename the old one aside, rename
     the new one in, delete the old).
  3. Open the live events file there: each logged line is queued (at most `max_pending`; the
     loop waits only when the writer is that far behind) and written by a background thread,
     flushed whenever the queue runs dry and on `close`.

A crash may leave the live file with steps after the last checkpoint (which the resume cuts
from metrics.jsonl and retrains), or without the lines still queued; step 2 of the next start
replaces the whole directory, so a resumed run's curves hold each step once, with the values
metrics.jsonl holds. A crash within step 2 leaves the old tensorboard/, or none (between its
two renames): the next start makes it again either way.

tensorboardX is imported when a log is opened, not with this module.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import socket
import threading
import time

from trace_jax.utils.io import atomic_directory

log = logging.getLogger(__name__)

DIRECTORY = "tensorboard"
_STOP = object()  # the queue's last item: the thread flushes, closes the file and returns


def scalars(record: dict) -> dict[str, float]:
  """{key: value} of the JSON numbers of a metrics line, but its step."""
  return {
    key: float(value)
    for key, value in record.items()
    if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
  }


def check_available() -> None:
  """A ValueError, before any work, when tensorboardX is not installed."""
  try:
    import tensorboardX  # noqa: F401
  except ImportError as e:
    raise ValueError(
      f"--tensorboard=true needs the tensorboardX package ({e}); pip install tensorboardX, "
      "or run with --tensorboard=false"
    ) from e


class EventLog:
  """The event files of the run whose metrics lines are `records` (see the module docstring):
  rewritten now from `records` and `config` (a JSON-ready dict), then appended by `log`.
  The caller holds the workdir (`RunDir`'s lock): no other writer's files are there."""

  def __init__(self, workdir: str, records: list[dict], config: dict, *, max_pending: int = 1000):
    self.directory = os.path.join(workdir, DIRECTORY)
    for name in os.listdir(workdir):
      if name.startswith(f".{DIRECTORY}.tmp-") or name.startswith(f".{DIRECTORY}.old-"):
        shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    with atomic_directory(self.directory) as staging:
      writer = _EventsFile(staging, "history")
      try:
        writer.write_text("config", _as_markdown(config), step=0)
        for record in records:
          writer.write_scalars(record["step"], scalars(record))
      finally:
        writer.close()
    self._queue: queue.Queue = queue.Queue(max_pending)
    self._thread = threading.Thread(
      target=_write_queued,
      args=(self._queue, _EventsFile(self.directory, "live")),
      name="tensorboard-writer",
      daemon=True,
    )
    self._thread.start()

  def log(self, record: dict) -> None:
    """Queue one metrics line (its step and numbers are read now: `record` may change later)."""
    if self._thread is None:
      raise ValueError(f"the TensorBoard log in {self.directory} is closed")
    self._queue.put((record["step"], scalars(record)))

  def close(self) -> None:
    """Write what is queued, flush and close the live file (idempotent)."""
    if self._thread is not None:
      self._queue.put(_STOP)
      self._thread.join()
      self._thread = None


class _EventsFile:
  """One events file: TFRecord framing (tensorboardX's RecordWriter) of Event protos."""

  def __init__(self, directory: str, suffix: str):
    from tensorboardX.proto import event_pb2, summary_pb2
    from tensorboardX.record_writer import RecordWriter

    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    # The time first (to the microsecond: a name of its own per start): TensorBoard reads a
    # directory's files in name order, and the live file's sorts after the history's.
    name = f"events.out.tfevents.{time.time():017.6f}.{socket.gethostname()}.{suffix}"
    self.path = os.path.join(directory, name)
    self._writer = RecordWriter(self.path)
    self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

  def _write(self, event) -> None:
    self._writer.write(event.SerializeToString())

  def write_scalars(self, step: int, values: dict[str, float]) -> None:
    summary = self._summary(
      value=[self._summary.Value(tag=tag, simple_value=v) for tag, v in values.items()]
    )
    self._write(self._event(wall_time=time.time(), step=int(step), summary=summary))

  def write_text(self, tag: str, text: str, step: int) -> None:
    from tensorboardX.summary import text as text_summary

    self._write(self._event(wall_time=time.time(), step=step, summary=text_summary(tag, text)))

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.flush()
    self._writer.close()


def _write_queued(pending: queue.Queue, events: _EventsFile) -> None:
  """The writer thread: queued lines to `events` until _STOP. A failed write is logged once
  and the rest dropped (the training goes on; the next start rewrites the files)."""
  failed = False
  while True:
    item = pending.get()
    try:
      if item is _STOP:
        events.close()
        return
      if not failed:
        events.write_scalars(*item)
        if pending.empty():
          events.flush()
    except Exception as e:  # noqa: BLE001 - a full disk must not stop the run
      if not failed:
        log.warning(
          "%s: writing TensorBoard events failed (%s: %s); no more are written until the "
          "next start, which rewrites them from metrics.jsonl",
          events.path,
          type(e).__name__,
          e,
        )
      failed = True
      if item is _STOP:
        return


def _as_markdown(config: dict) -> str:
  """The config's JSON as a markdown code block (TensorBoard renders text as markdown)."""
  return "\n".join("    " + line for line in json.dumps(config, indent=1).splitlines())
