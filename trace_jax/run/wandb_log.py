"""Weights & Biases logging of a run's metrics, beside the TensorBoard events (--wandb).

The same as TensorBoard gets (`run.tensorboard`): every JSON number of a metrics line a
scalar at its step (`tensorboard.scalars`), and the config, as the run's W&B config.

  <workdir>/wandb.json   {"run_id": ..., "logged_through": step}: the W&B run this workdir
                         logs to, and the last step it holds

metrics.jsonl stays the record. A W&B run's history cannot be rewritten (its steps only
grow), so a resume continues the same W&B run (`wandb.init(id=..., resume="allow")`) and
logs only the lines past `logged_through`:

  1. The id is made on the first start and written to wandb.json before `wandb.init`, so
     every later start, also after a crash, continues that run.
  2. On every start the lines of metrics.jsonl past `logged_through` are logged (all of
     them when --wandb is turned on mid-run); each logged line moves `logged_through` on.
  3. A resume retrains the steps between its checkpoint and the crash: they are in W&B
     already (with the same values: a resume is exact, but for the timings) and are not
     logged again, so each step appears once.

The files W&B writes go to <workdir>/wandb/ unless WANDB_DIR says otherwise; WANDB_MODE
(offline, disabled) and the project's other W&B variables apply as usual. A failed log is
said once and the rest dropped: the training goes on. The wandb package is imported when a
log is opened, not with this module (an extra: pip install 'trace_jax[wandb]').
"""

from __future__ import annotations

import json
import logging
import os
import uuid

from trace_jax.run.tensorboard import scalars
from trace_jax.utils.io import write_atomic

log = logging.getLogger(__name__)

STATE_FILE = "wandb.json"


def check_available() -> None:
  """A ValueError, before any work, when the wandb package is not installed."""
  try:
    import wandb  # noqa: F401
  except ImportError as e:
    raise ValueError(
      f"--wandb needs the wandb package ({e}): pip install 'trace_jax[wandb]' (the wandb "
      "extra), or run without --wandb"
    ) from e


def read_state(workdir: str) -> dict | None:
  """The workdir's wandb.json ({"run_id", "logged_through"}), or None if it has none.

  Raises:
    ValueError: it does not read as one (naming the file; W&B would start another run).
  """
  path = os.path.join(workdir, STATE_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      state = json.load(f)
    if not isinstance(state.get("run_id"), str) or not isinstance(state.get("logged_through"), int):
      raise TypeError("it needs a string run_id and an integer logged_through")
  except (OSError, ValueError, TypeError, AttributeError) as e:
    raise ValueError(
      f"{path} does not read as the W&B run of this workdir ({type(e).__name__}: {e}); move "
      "it away to log to a new W&B run"
    ) from e
  return state


class WandbLog:
  """The W&B run of the workdir's run, whose metrics lines are `records`: continued (or made)
  now, the lines past the ones it holds logged, then appended by `log`."""

  def __init__(self, workdir: str, records: list[dict], config: dict, *, project: str):
    import wandb

    self._path = os.path.join(workdir, STATE_FILE)
    state = read_state(workdir) or {"run_id": uuid.uuid4().hex[:12], "logged_through": -1}
    self.run_id, self.logged_through = state["run_id"], state["logged_through"]
    self._save()  # before init: every later start continues this run
    self._failed = False
    self._run = wandb.init(
      project=project,
      id=self.run_id,
      resume="allow",
      name=os.path.basename(os.path.normpath(workdir)),
      dir=None if os.environ.get("WANDB_DIR") else _made(os.path.join(workdir, "wandb")),
    )
    self._run.config.update(config, allow_val_change=True)  # a resume may change steps
    for record in records:
      self.log(record)

  def _save(self) -> None:
    write_atomic(
      self._path, json.dumps({"run_id": self.run_id, "logged_through": self.logged_through})
    )

  def log(self, record: dict) -> None:
    """Log one metrics line at its step, unless the W&B run holds that step already."""
    step = record["step"]
    if self._run is None or self._failed or step <= self.logged_through:
      return
    try:
      self._run.log(scalars(record), step=step)
      self.logged_through = step
      self._save()
    except Exception as e:  # noqa: BLE001 - a lost connection must not stop the run
      self._failed = True
      log.warning(
        "W&B run %s: logging step %d failed (%s: %s); no more lines are logged until the "
        "next start, which logs the rest from metrics.jsonl",
        self.run_id,
        step,
        type(e).__name__,
        e,
      )

  def close(self) -> None:
    """Finish the W&B run (idempotent): what was logged is written out."""
    if self._run is not None:
      run, self._run = self._run, None
      run.finish()


def _made(path: str) -> str:
  os.makedirs(path, exist_ok=True)
  return path
