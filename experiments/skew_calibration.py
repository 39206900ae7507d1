"""Calibrate the rollout skew: the mismatch study at each of --skews, from one SFT warm start.

  python experiments/skew_calibration.py  # tiny, skews 0 and 2^-9..2^-5: ~8 min on 2 cores
  python experiments/skew_calibration.py --bf16_reference_k3=1e-3 --fp4_reference_k3=1e-2
  python experiments/skew_calibration.py --skews=0,0.01 --rollouts=4 --sft_steps=5 --out=/tmp/c

Every StudyConfig flag but --rollout_skew (each cell's skew comes from --skews), at the
study's defaults except those a calibration sets (the tiny preset, 128 rollouts; no layer
sweep, no geometries, a delta sweep of --delta alone): the modes are the study's own (bf16, none,
none+replay, compact, full, sparse), measured against the unskewed training path while
both rollouts are skewed (`model.skew`). The warm start is the same at every skew, so it
is trained once (`mismatch.warm_start`) and only when a cell still has to run.

Each skew's study is written to <out>/skew_<skew>.json as it finishes; a rerun skips the
skews whose file holds the same config (and says so). Then <out>/results.json (per skew:
each mode's k3, code disagreement and one-step share, and the config), <out>/table.md (k3
per mode, code disagreement of none, by skew) and <out>/k3_vs_skew.png. With
--bf16_reference_k3 / --fp4_reference_k3 it names the skew whose bf16 / none (FP4 QAT) k3
is nearest each in log distance.

At the defaults on 2 shared cores: the warm start 11-23 s, the first skew 116 s (its
compiles), each later one 56 s (64 rollouts: 59-111 s and 34 s): about 7 minutes in all.
"""

import dataclasses
import json
import math
import os
import time

from absl import app, flags, logging
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from trace_jax import fp4 as fp4_lib  # noqa: E402
from trace_jax.studies import mismatch  # noqa: E402
from trace_jax.studies.mismatch import MODES, StudyConfig  # noqa: E402
from trace_jax.utils import flags as config_flags  # noqa: E402
from trace_jax.utils import markdown_table, write_atomic, write_json  # noqa: E402
from trace_jax.utils.flags import flat_fields  # noqa: E402

SKEWS = (0.0, 2.0**-9, 2.0**-8, 2.0**-7, 2.0**-6, 2.0**-5)
# The study's defaults a calibration lowers: what it does not report is not computed.
DEFAULTS = {
  "preset": "tiny",
  "rollouts": 128,  # twice the study's: k3 at neighbouring skews is a small difference
  "layer_sweep": False,
  "geometries": False,
  "delta_sweep": [str(fp4_lib.DEFAULT_DELTA)],
}
CELL_KEYS = ("k3_kl", "code_disagree_frac", "one_step_frac")
FLOOR = 1e-12  # k3 below it is plotted at it

_SKEWS = flags.DEFINE_list(
  "skews", [repr(s) for s in SKEWS], "Rollout skews to study (comma-separated, >= 0)."
)
_OUT = flags.DEFINE_string("out", "runs/skew_calibration", "Output directory.")
_BF16_REF = flags.DEFINE_float(
  "bf16_reference_k3", None, "A published bf16 engine-vs-trainer k3: name the nearest skew."
)
_FP4_REF = flags.DEFINE_float(
  "fp4_reference_k3", None, "A published FP4 engine-vs-trainer k3: name the nearest skew."
)
_CONFIG = config_flags.define_flags(
  StudyConfig, only=[n for n in flat_fields(StudyConfig) if n != "rollout_skew"]
)
for _name, _value in DEFAULTS.items():
  flags.FLAGS.set_default(_name, _value)


def parse_skews(strings: list[str]) -> tuple[float, ...]:
  """The skews in the order given; a ValueError names --skews and what is wrong."""
  try:
    skews = tuple(float(s) for s in strings)
  except ValueError as e:
    raise ValueError(f"--skews={','.join(strings)} must be numbers") from e
  if not skews:
    raise ValueError("--skews is empty; give at least one skew")
  if len(set(skews)) != len(skews):
    raise ValueError(f"--skews={','.join(strings)} repeats a skew")
  return skews


def cell_path(out: str, skew: float) -> str:
  return os.path.join(out, f"skew_{skew!r}.json")


def _same_config(path: str, config: StudyConfig) -> bool:
  """Whether `path` holds a finished cell of `config` (JSON round trip: tuples as lists)."""
  try:
    with open(path) as f:
      held = json.load(f).get("config")
  except (OSError, ValueError, AttributeError):  # none there, or not a cell
    return False
  return held == json.loads(json.dumps(config.to_json()))


def run_cells(configs: dict, out: str) -> dict:
  """{skew: the study's JSON}: each read from its cell file when it holds the same config,
  else run (one warm start shared by all that run) and written atomically."""
  results, warm = {}, None
  for skew, config in tqdm(configs.items(), desc="skews", unit="skew"):
    path = cell_path(out, skew)
    if _same_config(path, config):
      tqdm.write(f"skew {skew!r}: skipped, {path} holds it with the same config")
      with open(path) as f:
        results[skew] = json.load(f)
      continue
    if os.path.exists(path):
      tqdm.write(f"skew {skew!r}: {path} holds another config; running it again")
    if warm is None:
      start = time.time()
      warm = mismatch.warm_start(config)
      tqdm.write(f"warm start ({config.sft_steps} SFT steps): {time.time() - start:.0f} s")
    study = mismatch.run_study(config, progress=False, warm=warm).to_json()
    write_json(path, study)
    tqdm.write(f"skew {skew!r}: {study['seconds']:.0f} s, wrote {path}")
    results[skew] = study
  return results


def summarize(results: dict) -> list[dict]:
  """Per skew: each mode's k3, code disagreement and one-step share, and the config."""
  return [
    {
      "rollout_skew": skew,
      "modes": {m: {k: study["modes"][m].get(k) for k in CELL_KEYS} for m in MODES},
      "seconds": study["seconds"],
      "config": study["config"],
    }
    for skew, study in results.items()
  ]


def nearest(rows: list[dict], mode: str, reference: float) -> dict:
  """The row whose `mode` k3 is nearest `reference` in |log k3 - log reference|."""
  dist = lambda r: abs(math.log(max(r["modes"][mode]["k3_kl"], 1e-30) / reference))  # noqa: E731
  best = min(rows, key=dist)
  return {
    "mode": mode,
    "reference_k3": reference,
    "rollout_skew": best["rollout_skew"],
    "k3_kl": best["modes"][mode]["k3_kl"],
    "log_distance": dist(best),
  }


def table(rows: list[dict]) -> str:
  pct = lambda v: "-" if v is None else f"{v:.4%}"  # noqa: E731
  return markdown_table(
    ["rollout_skew", *(f"k3 {m}" for m in MODES), "code disagree (none)"],
    [
      (
        f"{r['rollout_skew']:g}",
        *(f"{r['modes'][m]['k3_kl']:.3e}" for m in MODES),
        pct(r["modes"]["none"]["code_disagree_frac"]),
      )
      for r in rows
    ],
  )


def _skew_label(skew: float) -> str:
  """0, 2^k for a power of two, else the value."""
  if skew == 0:
    return "0"
  k = math.log2(skew)
  return f"2^{int(k)}" if k == int(k) else f"{skew:g}"


def plot(rows: list[dict], path: str) -> None:
  """k3 against skew per mode on log axes; skew 0 at a marked position 4x left of the
  smallest nonzero skew."""
  positive = sorted(r["rollout_skew"] for r in rows if r["rollout_skew"] > 0)
  zero_x = positive[0] / 4 if positive else 1.0
  order = sorted(rows, key=lambda r: r["rollout_skew"])
  xs = [r["rollout_skew"] or zero_x for r in order]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for mode in MODES:
    ks = [max(r["modes"][mode]["k3_kl"], FLOOR) for r in order]
    ax.loglog(xs, ks, marker="o", label=mode)
  ax.set_xticks(xs, [_skew_label(r["rollout_skew"]) for r in order], rotation=45)
  ax.minorticks_off()
  if any(r["rollout_skew"] == 0 for r in rows):
    ax.axvline(zero_x, c="gray", ls=":", lw=0.8)
    ax.annotate(
      " skew 0 (placed 4x left of the smallest)",
      (zero_x, 0.02),
      xycoords=("data", "axes fraction"),
      fontsize=7,
      color="gray",
    )
  preset = rows[0]["config"]["preset"]
  ax.set(
    xlabel="rollout skew s (each layer's output x 1 + s u on both rollouts)",
    ylabel="mismatch/k3_kl",
    title=f"{preset}: rollout vs training path by rollout skew",
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  try:
    skews = parse_skews(_SKEWS.value)
    base = config_flags.from_flags(StudyConfig, _CONFIG)
    configs = {s: dataclasses.replace(base, rollout_skew=s) for s in skews}
    for name, ref in (("bf16_reference_k3", _BF16_REF.value), ("fp4_reference_k3", _FP4_REF.value)):
      if ref is not None and not (ref > 0 and math.isfinite(ref)):
        raise ValueError(f"--{name}={ref} must be a positive finite k3")
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  out = _OUT.value
  rows = summarize(run_cells(configs, out))
  summary = {"rows": rows}
  refs = (("bf16", _BF16_REF.value), ("none", _FP4_REF.value))
  summary["nearest"] = [nearest(rows, mode, ref) for mode, ref in refs if ref is not None]
  write_json(os.path.join(out, "results.json"), summary)
  text = table(rows)
  write_atomic(os.path.join(out, "table.md"), text + "\n")
  plot(rows, os.path.join(out, "k3_vs_skew.png"))
  print()
  print(text)
  for n in summary["nearest"]:
    print(
      f"reference k3 {n['reference_k3']:.3e}: mode {n['mode']} is nearest at skew "
      f"{n['rollout_skew']:g} (k3 {n['k3_kl']:.3e}, |log ratio| {n['log_distance']:.2f})"
    )
  print(f"\nwrote {out}/results.json, table.md, k3_vs_skew.png")


if __name__ == "__main__":
  app.run(main)
