"""What `gpu_check.py` measured, kept as it goes: one `Recorder` per section process.

Each measurement runs inside `Recorder.measure`: it starts only if its estimated seconds fit
what is left of the process's budget, a failure is recorded with its error (the next
measurement still runs), and `results.json` and `report.md` under --out are rewritten after
every one, each replaced whole. The sections run as separate processes on one --out folder
(`gpu_window.sh`), so a recorder starts from the folder's `results.json`: a later section
reads what an earlier one measured (the copy bandwidth, the fair bf16 MoE), and a section
killed by its time cap loses only the measurement it was in.

`results.json`:
  device, jax, smoke        where it ran
  sections                  {section: {status, seconds}}
  measurements              {section: [{name, status, seconds, ...what it measured}]}
  reports                   {section: the markdown it printed}
  targets                   [{target, measured, goal, verdict, section}]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback
from typing import Callable

import jax
import numpy as np

from trace_jax.utils.io import write_atomic
from trace_jax.utils.timing import markdown_table

SECTIONS = ("probe", "kernels", "decode", "rollout")  # in order of value
# Seconds a measurement is assumed to take before one like it has run (the first of a kind):
# what an H200 took at the full shapes, rounded up.
FIRST_ESTIMATE_S = dict(attention=5, gemm=5, moe=8, parity=40, decode_case=40, rollout_arm=120)


class Recorder:
  """One section's measurements, written under `out` (None: printed only) as they finish."""

  def __init__(self, out: str | None, section: str, *, deadline: float, header: dict):
    self.out, self.section, self.deadline = out, section, deadline
    self.results = _read(out) or dict(header, sections={}, measurements={}, reports={})
    self.results.update(header)
    for key in ("sections", "measurements", "reports"):
      self.results.setdefault(key, {})
    self.results.setdefault("targets", [])
    self.results["targets"] = [t for t in self.results["targets"] if t["section"] != section]
    self.results["measurements"][section] = []
    self.results["reports"][section] = ""
    self.results["sections"][section] = dict(status="running", seconds=0.0)
    self.started = time.time()
    self.write()

  # --- what the other sections measured ---------------------------------------------

  def earlier(self, section: str, name: str) -> dict | None:
    """An earlier section's measurement `name` if it finished ok, else None."""
    for m in self.results["measurements"].get(section, []):
      if m["name"] == name and m["status"] == "ok":
        return m
    return None

  # --- recording ------------------------------------------------------------------------

  def left(self) -> float:
    return self.deadline - time.time()

  def measure(self, name: str, fn: Callable[[], dict], estimate_s: float = 0.0) -> dict | None:
    """Runs fn() -> {what it measured} unless `estimate_s` exceeds the time left; records
    the outcome as `name` (status "ok", "skipped: ..." or "failed: ...") and writes."""
    record: dict = dict(name=name)
    left = self.left()
    if estimate_s > left:
      record.update(status=f"skipped: needs ~{estimate_s:.0f} s, {max(left, 0):.0f} s left")
      record.update(seconds=0.0)
      self.print(f"{name}: {record['status']}")
      values = None
    else:
      start = time.time()
      try:
        values = fn()
        record.update(status="ok")
      except Exception as error:  # noqa: BLE001 (one failure must not hide the rest)
        values = None
        record.update(status=f"failed: {type(error).__name__}: {str(error)[:400]}")
        self.print(f"{name} failed: {type(error).__name__}: {str(error)[:2000]}")
        traceback.print_exc(limit=6, file=sys.stdout)
      record.update(seconds=round(time.time() - start, 2))
      record.update(values or {})
    self.results["measurements"][self.section].append(_finite(record))
    self.write()
    return values

  def print(self, text: str = "") -> None:
    print(text, flush=True)
    self.results["reports"][self.section] += text + "\n"

  def target(self, name: str, measured: str, goal: str, ok: bool | None) -> None:
    verdict = "-" if ok is None else ("PASS" if ok else "FAIL")
    self.results["targets"].append(
      dict(target=name, measured=measured, goal=goal, verdict=verdict, section=self.section)
    )

  def finish(self, status: str) -> None:
    self.results["sections"][self.section] = dict(
      status=status, seconds=round(time.time() - self.started, 1)
    )
    self.write()

  def write(self) -> None:
    if self.out is None:
      return
    os.makedirs(self.out, exist_ok=True)
    write_atomic(os.path.join(self.out, "results.json"), json.dumps(self.results, indent=1))
    write_atomic(os.path.join(self.out, "report.md"), report(self.results))


def report(results: dict) -> str:
  """report.md: the header, each section's printout in order, then the targets."""
  lines = [
    f"# gpu_check on {results.get('device')}, jax {results.get('jax')}"
    + (" (smoke shapes)" if results.get("smoke") else ""),
    "",
  ]
  for section in SECTIONS:
    if section not in results["sections"]:
      continue
    state = results["sections"][section]
    lines += [f"## {section} ({state['status']}, {state['seconds']:.0f} s)", ""]
    lines += [results["reports"].get(section, "").rstrip(), ""]
  targets = results.get("targets", [])
  lines += ["## targets", ""]
  rows = [(t["target"], t["measured"], t["goal"], t["verdict"]) for t in targets]
  lines += [markdown_table(["target", "measured", "goal", "verdict"], rows), ""]
  return "\n".join(lines)


def _read(out: str | None) -> dict | None:
  if out is None or not os.path.exists(os.path.join(out, "results.json")):
    return None
  with open(os.path.join(out, "results.json")) as f:
    return json.load(f)


def _finite(value):
  """JSON without NaN or Infinity (strict readers refuse them): non-finite floats as text."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_finite(v) for v in value]
  return value


@dataclasses.dataclass
class Run:
  """The run's shapes and roofline, and the recorder of the section in progress."""

  shapes: dict
  peak: float  # datasheet bytes / s
  rec: Recorder
  calls: int  # profiled calls per measurement
  smoke: bool  # tiny shapes, no time estimates
  options: dict  # the sections' own flags, by name
  seconds: dict = dataclasses.field(default_factory=dict)  # kind -> last measurement's s

  @property
  def copy(self) -> float | None:
    """The measured copy bandwidth, bytes / s (None: probe did not measure it)."""
    m = self.rec.earlier("probe", "copy_bandwidth")
    return None if m is None else m["copy_gbps"] * 1e9

  def estimate(self, kind: str) -> float:
    return 0.0 if self.smoke else self.seconds.get(kind, FIRST_ESTIMATE_S[kind])

  def measure(self, kind: str, name: str, fn) -> dict | None:
    values = self.rec.measure(name, fn, self.estimate(kind))
    done = self.rec.results["measurements"][self.rec.section][-1]
    if done["status"] == "ok":
      self.seconds[kind] = done["seconds"]
    return values

  def shares(self, nbytes: int, seconds: float) -> dict:
    """Roofline shares of reading `nbytes` in `seconds`: measured copy and datasheet."""
    out = dict(bytes=int(nbytes), device_us=seconds * 1e6)
    out["of_datasheet"] = nbytes / seconds / self.peak
    if self.copy:
      out["of_copy"] = nbytes / seconds / self.copy
    return out

  def share_text(self, values: dict) -> str:
    copy = f"{values['of_copy']:.0%}" if "of_copy" in values else "-"
    return f"{copy} / {values['of_datasheet']:.0%}"


def tree_bytes(*trees) -> int:
  return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(trees)))


def micros(seconds: float) -> str:
  return f"{seconds * 1e6:.1f}"


def gigabytes(value) -> str:
  return "-" if value is None else f"{value / 1e9:.2f}"


def fair_moe_kind(run: Run, batch: int) -> tuple[str, str]:
  """(kind, why) of the fair bf16 MoE at `batch`: the fastest in `kernels` at the nearest
  measured batch, else "dense" at >= 32 rows and "gather" below (what wins there on an
  H200 by the roofline: nearly every expert routed, or few)."""
  found = [
    m
    for m in run.rec.results["measurements"].get("kernels", [])
    if m["name"].startswith("fair bf16 MoE") and m["status"] == "ok"
  ]
  if found:
    nearest = min(found, key=lambda m: abs(np.log2(m["batch"]) - np.log2(max(batch, 1))))
    return nearest["kind"], f"fastest in kernels at batch {nearest['batch']}"
  kind = "dense" if batch >= 32 else "gather"
  return kind, "kernels did not run: by batch"


def mark_killed(out: str, section: str, cap: float) -> None:
  """Records that `section`'s process was killed at its time cap (gpu_window.sh): its
  status, and report.md rewritten; what it measured before stays."""
  results = _read(out) or dict(sections={}, measurements={}, reports={}, targets=[])
  results.setdefault("sections", {})[section] = dict(
    status=f"killed at its time cap ({cap:.0f} s)", seconds=float(cap)
  )
  results.setdefault("reports", {}).setdefault(section, "")
  write_atomic(os.path.join(out, "results.json"), json.dumps(results, indent=1))
  write_atomic(os.path.join(out, "report.md"), report(results))


if __name__ == "__main__":
  import argparse  # noqa: PLC0415

  parser = argparse.ArgumentParser(description="Mark a section killed at its time cap.")
  parser.add_argument("--out", required=True)
  parser.add_argument("--killed", required=True, choices=SECTIONS)
  parser.add_argument("--cap", type=float, required=True)
  args = parser.parse_args()
  mark_killed(args.out, args.killed, args.cap)
