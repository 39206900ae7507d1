"""Loading a `dataset:PATH` task: seconds and peak memory for JSONL and Parquet files.

  python experiments/bench_data.py                 # 100,000 rows, both column styles
  python experiments/bench_data.py --rows=20000

Writes procedurally generated files (GSM8K style: question/answer "... #### N"; verl style:
prompt messages, reward_model.ground_truth, data_source, response) in JSONL and Parquet to a
temporary directory, then builds `get_task("dataset:FILE")` for each in a process of its own
and prints a table: the seconds to build the task (read, check every row, make the items)
and the process's peak resident memory (`resource.getrusage`, ru_maxrss) after the imports
and after the load, beside the baseline: the plain read of the same file (`json.loads` per
line, `pyarrow.parquet.read_table(...).to_pylist()`), no checks and no items.
"""

import json
import os
import random
import subprocess
import sys
import tempfile

from absl import app, flags

_ROWS = flags.DEFINE_integer("rows", 100_000, "Rows per generated file.")

_CHILD = """
import json, resource, sys, time
from trace_jax.tasks.registry import get_task
import pyarrow.parquet, math_verify  # imported before the baseline: the load's memory only
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
task = get_task("dataset:" + sys.argv[1])
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
# The baseline: the plain read of the same file, no checks and no items (the floor).
start = time.perf_counter()
if sys.argv[1].endswith(".parquet"):
  rows = pyarrow.parquet.read_table(sys.argv[1]).to_pylist()
else:
  with open(sys.argv[1]) as f:
    rows = [json.loads(line) for line in f]
raw = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rss_before_kb": before, "rss_after_kb": after,
                  "problems": len(task.problems("train")), "raw_seconds": raw}))
"""


def _rows(style: str, n: int, rng: random.Random) -> list[dict]:
  rows = []
  for i in range(n):
    a, b = rng.randint(1, 999), rng.randint(1, 999)
    if style == "gsm8k":
      rows.append(
        {
          "question": f"Ann has {a} pens and buys {b} more. How many?",
          "answer": f"{a}+{b}\n#### {a + b}",
        }
      )
    else:
      rows.append(
        {
          "data_source": "bench/gsm8k",
          "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
          "reward_model": {"style": "rule", "ground_truth": str(a + b)},
          "extra_info": {"index": i},
          "response": f"{a}+{b}={a + b}. #### {a + b}",
        }
      )
  return rows


def _write(directory: str, style: str, rows: list[dict]) -> list[str]:
  import pyarrow as pa
  import pyarrow.parquet as pq

  jsonl = os.path.join(directory, f"{style}.jsonl")
  with open(jsonl, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  parquet = os.path.join(directory, f"{style}.parquet")
  pq.write_table(pa.Table.from_pylist(rows), parquet)
  return [jsonl, parquet]


def main(argv):
  del argv
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  rng = random.Random(0)
  print(
    f"{'file':<16} {'rows':>8} {'MB':>7} {'seconds':>8} {'plain read s':>12} {'ratio':>6} "
    f"{'peak RSS MB':>12} {'load MB':>8}"
  )
  with tempfile.TemporaryDirectory() as directory:
    for style in ("gsm8k", "verl"):
      for path in _write(directory, style, _rows(style, _ROWS.value, rng)):
        out = subprocess.run(
          [sys.executable, "-c", _CHILD, path], capture_output=True, text=True, env=env
        )
        if out.returncode:
          raise SystemExit(f"{path}: {out.stderr.strip().splitlines()[-1]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
          f"{os.path.basename(path):<16} {r['problems']:>8} "
          f"{os.path.getsize(path) / 1e6:>7.1f} {r['seconds']:>8.2f} {r['raw_seconds']:>12.2f} "
          f"{r['seconds'] / r['raw_seconds']:>5.1f}x "
          f"{r['rss_after_kb'] / 1024:>12.0f} {(r['rss_after_kb'] - r['rss_before_kb']) / 1024:>8.0f}"
        )


if __name__ == "__main__":
  app.run(main)
