"""The mismatch map: where plain FP4 QAT's mismatch is largest (answer length, depth, engine
difference), for fp4-qat, fp4-qat-r3 (routing replay), trace and trace-full, before any RL.

  python experiments/mismatch_map.py                       # the whole map, resuming (~1 h)
  python experiments/mismatch_map.py --terms=32 --layers=4 --rollout_skew=0.0625 --out=DIR
  python experiments/mismatch_map.py --terms=8 --layers=16 --router_dtype=compute --out=DIR
  python experiments/mismatch_map.py --preset=tiny --sft_steps=5 --rollouts=4 --terms=4 \
      --layers=2 --out=/tmp/map                          # a quick look

With --terms, --layers, --rollout_skew or --router_dtype it measures one point (the others at
the map's base: 8 terms, 4 layers, skew 0, float32 router); without, every point of
`studies.mismatch_map.default_points` (4, 8, 16 and 32 terms at 4 layers; 8 and 16 layers
at 8 terms; each on three engines: the same, --rollout_skew 2^-4, the rollout's router in
bf16), one warm start per (terms, layers), skipping the points --out already holds.

Writes under --out (default experiments/results/mismatch_map/), after every point:
results.json (`config`, and `points`: terms, layers, rollout_skew, router_dtype,
answer_tokens and per path k3_mean, k3_p99, extreme_share, seq_logratio_mean,
seq_logratio_p90, router_flip_rate and code_disagreement, the last two per layer), table.md,
length.png (each metric against the answer's tokens) and depth.png (against layers).
"""

import json
import os
import sys
import time

import matplotlib
from absl import app, flags, logging

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from trace_jax.model.quant import ROUTER_DTYPES  # noqa: E402
from trace_jax.studies import mismatch_map as study  # noqa: E402
from trace_jax.utils import flags as config_flags  # noqa: E402
from trace_jax.utils import markdown_table, write_json  # noqa: E402
from trace_jax.utils.io import write_atomic  # noqa: E402

_OUT = flags.DEFINE_string("out", "experiments/results/mismatch_map", "Results folder.")
_TERMS = flags.DEFINE_integer("terms", None, "One point: chain terms (base 8).")
_LAYERS = flags.DEFINE_integer("layers", None, "One point: layers (base 4).")
_SKEW = flags.DEFINE_float("rollout_skew", None, "One point: the rollout's skew (base 0).")
_ROUTER = flags.DEFINE_enum(
  "router_dtype", None, list(ROUTER_DTYPES), "One point: the rollout's router (base float32)."
)
_CONFIG = config_flags.define_flags(study.MapConfig)
BASE = dict(terms=8, layers=4, rollout_skew=0.0, router_dtype="float32")
SHOWN = ("k3_mean", "k3_p99", "extreme_share", "seq_logratio_p90")
SHOWN += ("router_flip_rate_mean", "code_disagreement_mean")


def _read(path: str, config: dict) -> list[dict]:
  """The points a results.json of the same config holds (a ValueError for another's)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    saved = json.load(f)
  if saved.get("config") != config:
    differ = sorted(
      k for k in set(config) | set(saved["config"]) if saved["config"].get(k) != config.get(k)
    )
    raise ValueError(
      f"{path} holds a map of another config (fields {differ} differ): use another --out, "
      "or the flags it was made with"
    )
  return saved["points"]


def _key(row: dict) -> tuple:
  return (row["terms"], row["layers"], float(row["rollout_skew"]), row["router_dtype"])


def _engine(row: dict) -> str:
  if row["router_dtype"] == "compute":
    return "bf16 router"
  return f"skew {row['rollout_skew']:g}" if row["rollout_skew"] else "same engine"


def table(points: list[dict]) -> str:
  rows = []
  for r in sorted(points, key=_key):
    for name, m in r["paths"].items():
      rows.append(
        (
          r["terms"],
          r["layers"],
          _engine(r),
          f"{r['answer_tokens']:.0f}",
          name,
          *(f"{m[k]:.3g}" for k in SHOWN),
        )
      )
  headers = ["terms", "layers", "engine", "answer tokens", "path", *SHOWN]
  return markdown_table(headers, rows)


def plot(points: list[dict], out: str) -> list[str]:
  """length.png (at the depth most points have: the base) and depth.png (at the length most
  points have): each metric per path, one line style per engine."""
  written = []
  common = lambda field: max(  # noqa: E731
    {r[field] for r in points}, key=lambda v: sum(r[field] == v for r in points)
  )
  for axis, fixed, x_of, name in (
    ("answer tokens", ("layers", common("layers")), lambda r: r["answer_tokens"], "length.png"),
    ("layers", ("terms", common("terms")), lambda r: r["layers"], "depth.png"),
  ):
    rows = [r for r in points if r[fixed[0]] == fixed[1]]
    if not rows:
      continue
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    styles = {"same engine": "-", "bf16 router": ":"}
    for ax, metric in zip(axes.flat, SHOWN):
      for path, color in zip(study.PATHS, ("C3", "C1", "C0", "C2")):
        for engine in sorted({_engine(r) for r in rows}):
          line = sorted((x_of(r), r["paths"][path][metric]) for r in rows if _engine(r) == engine)
          ax.plot(
            *zip(*line),
            ls=styles.get(engine, "--"),
            marker="o",
            color=color,
            label=f"{path}, {engine}",
          )
      ax.set(xlabel=axis, ylabel=metric, yscale="symlog", title=metric)
      ax.set_yscale("symlog", linthresh=1e-6)
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(f"FP4 rollout against the training path, by {axis} ({fixed[0]} {fixed[1]})")
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=100)
    plt.close(fig)
    written.append(name)
  return written


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  try:
    config = config_flags.from_flags(study.MapConfig, _CONFIG)
    single = {
      k: v
      for k, v in (
        ("terms", _TERMS.value),
        ("layers", _LAYERS.value),
        ("rollout_skew", _SKEW.value),
        ("router_dtype", _ROUTER.value),
      )
      if v is not None
    }
    points = [study.MapPoint(**{**BASE, **single})] if single else study.default_points()
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  out = os.path.abspath(_OUT.value)
  os.makedirs(out, exist_ok=True)
  results_path = os.path.join(out, "results.json")
  saved = dict(config=config_flags.to_flat(config))
  try:
    done = {_key(r): r for r in _read(results_path, saved["config"])}
  except ValueError as e:
    print(f"mismatch_map.py: error: {e}", file=sys.stderr)
    sys.exit(1)
  todo = [p for p in points if single or p.key not in done]
  print(f"{len(points)} point(s), {len(points) - len(todo)} already in {results_path}")
  groups: dict = {}
  for p in todo:
    groups.setdefault((p.terms, p.layers), []).append(p)
  count = 0
  for (terms, layers), group in groups.items():
    start = time.time()
    policy, losses = study.warm_start(config, terms, layers)
    nll = f", SFT NLL {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else ""
    print(f"warm start {terms} terms, {layers} layers: {time.time() - start:.0f} s{nll}")
    for point in group:
      count += 1
      row = study.measure_point(config, point, policy)
      row["sft_nll"] = [round(losses[0], 4), round(losses[-1], 4)] if losses else None
      done[point.key] = row
      rows = sorted(done.values(), key=_key)
      write_json(results_path, dict(saved, points=rows))
      write_atomic(os.path.join(out, "table.md"), table(rows) + "\n")
      plot(rows, out)
      qat = row["paths"]["fp4-qat"]
      print(
        f"[{count}/{len(todo)}] {terms} terms, {layers} layers, {_engine(row)}: "
        f"{row['answer_tokens']:.0f} answer tokens, fp4-qat k3 {qat['k3_mean']:.2e} (p99 "
        f"{qat['k3_p99']:.2e}), seq |log r| p90 {qat['seq_logratio_p90']:.3f}, router flips "
        f"{qat['router_flip_rate_mean']:.3f}; trace k3 {row['paths']['trace']['k3_mean']:.2e}"
        f" ({row['seconds']:.0f} s)"
      )
  print(f"wrote {results_path}, table.md, length.png, depth.png")


if __name__ == "__main__":
  app.run(main)
