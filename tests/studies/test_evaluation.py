"""A checkpoint evaluated alone (`studies.evaluation`, `experiments/eval.py`): the pass@k
estimator against every k-subset of the samples, the figures against the per-problem
records, the run's files untouched, bad settings refused before any weight is read.

The run is real but short: a tiny Trainer saving its step-0 checkpoint, without training
(an RL step compiles for a minute on 2 cores)."""

import contextlib
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from absl import flags

from trace_jax.export.run import SavedRun
from trace_jax.rl.config import RLConfig
from trace_jax.run import policy_source
from trace_jax.run.trainer import Trainer
from trace_jax.studies import evaluation
from trace_jax.studies.evaluation import EvalSettings, pass_at_k

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "eval.py")
RUN = dict(
  task="arith",
  preset="tiny",
  steps=1,
  prompts_per_step=2,
  group_size=2,
  max_new_tokens=6,
  sft_steps=0,
  eval_size=3,
  eval_every=1,
  checkpoint_every=1,
  tensorboard=False,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A workdir holding a step-0 checkpoint, run.json, a metrics line and a summary."""
  workdir = tmp_path_factory.mktemp("evaluation") / "my run"
  with Trainer(RLConfig.from_flat(**RUN), str(workdir), progress=False) as trainer:
    trainer.save()
    trainer.rundir.log({"step": 0, "eval/reward_fp4": 0.0})
    trainer.rundir.write_summary({"arm": "trace", "steps": 0})
  return str(workdir)


def _hashes(folder) -> dict:
  """Every file under `folder` with the sha256 of its bytes."""
  out = {}
  for directory, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(directory, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


def _pass_at_k_by_subsets(correct: list[bool], k: int) -> float:
  """The definition: the share of the k-subsets of the samples holding a correct one."""
  subsets = list(itertools.combinations(correct, k))
  return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample():
  rng = np.random.default_rng(0)
  for _ in range(60):
    n = int(rng.integers(1, 11))
    correct = list(rng.random(n) < rng.random())
    for k in range(1, n + 1):
      assert pass_at_k(n, sum(correct), k) == pytest.approx(
        _pass_at_k_by_subsets(correct, k), abs=1e-12
      )
  # by hand: one correct of 4, pairs: 3 of the C(4, 2) = 6 pairs miss it
  assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
  assert (pass_at_k(5, 0, 3), pass_at_k(5, 3, 3), pass_at_k(5, 5, 1)) == (0.0, 1.0, 1.0)
  # where the binomials overflow a float64: one correct of 2000, half drawn
  assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)
  for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4.0, 1, 1)]:
    with pytest.raises(ValueError, match=r"pass_at_k\(n="):
      pass_at_k(*bad)


def test_default_ks_and_bad_settings_name_the_setting():
  assert [evaluation.default_ks(n) for n in (0, 1, 4, 6)] == [(), (1,), (1, 2, 4), (1, 2, 4, 6)]
  assert EvalSettings(samples=8, ks=(8, 1)).ks == (1, 8)
  for settings, match in [
    (dict(samples=-1), r"samples=-1: use a whole number >= 0"),
    (dict(samples=4, ks=(5,)), r"k=\[5\]: .* a whole number from 1 to samples=4"),
    (dict(samples=4, ks=(2, 2)), r"k=\[2, 2\]: .* each once"),
    (dict(ks=(1,)), r"k=\[1\]: pass@k needs sampled answers; use samples >= 1"),
    (dict(precisions=("fp8",)), r"precisions='fp8': use one or both of bf16,fp4"),
    (dict(precisions=()), r"precisions='': use one or both"),
  ]:
    with pytest.raises(ValueError, match=match):
      EvalSettings(**settings)


def test_one_problem_prints_its_figure_without_an_error():
  assert evaluation.figure(0.0, float("nan")) == "0.000"
  assert evaluation.figure(0.4012345, 0.1234567) == "0.401 ± 0.123"
  results = {
    "ks": [1],
    "samples": 1,
    "precisions": {
      "fp4": {
        name: value
        for figure in ("greedy/reward", "greedy/pass@1", "pass@1", "mean@1")
        for name, value in ((figure, 0.0), (f"{figure}_se", float("nan")))
      }
    },
  }
  table = evaluation.table(results)
  assert "nan" not in table and "| fp4 | 0.000 | 0.000 | 0.000 | 0.000 |" in table


@contextlib.contextmanager
def _script(*argv):
  """experiments/eval.py's `main`, its flags parsed from `argv`, in this process (its
  compilations shared with the other tests); the flags are removed after. A flag of the
  same name that another script loaded in this process defined (rl.py's --workdir) is set
  aside meanwhile and put back after."""
  before = set(flags.FLAGS)
  aside = {}
  while True:
    spec = importlib.util.spec_from_file_location("eval_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    try:
      spec.loader.exec_module(script)
      break
    except flags.DuplicateFlagError as error:
      name = re.search(r"The flag '([^']+)' is defined twice", str(error)).group(1)
      for added in set(flags.FLAGS) - before:  # the partial load's own flags
        delattr(flags.FLAGS, added)
      aside[name] = flags.FLAGS[name]
      delattr(flags.FLAGS, name)
      before.discard(name)
  try:
    flags.FLAGS(["eval.py", *argv])
    yield script
  finally:
    flags.FLAGS.unparse_flags()
    for name in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, name)
    for name, flag in aside.items():
      flags.FLAGS[name] = flag


def test_a_run_is_evaluated_in_both_precisions_and_its_files_keep_every_byte(
  run, tmp_path, capsys, monkeypatch
):
  """`eval.py --workdir=RUN --samples=4`: pass@1 and pass@4 in FP4 and bf16, written in
  a folder of its own (evals/<run>-step<N>-<task>-<time>), the table printed with every
  figure rounded; every file of the run hashes the same after."""
  before = _hashes(run)
  monkeypatch.chdir(tmp_path)  # the default output folder, evals/..., is made here
  with _script(f"--workdir={run}", "--samples=4", "--noprogress") as script:
    script.main([])
  assert _hashes(run) == before
  (out,) = (tmp_path / "evals").iterdir()
  assert out.name.startswith("my_run-step0-arith-")
  assert sorted(os.listdir(out)) == ["problems.jsonl", "results.json", "results.md"]
  results = json.loads((out / "results.json").read_text())
  assert results["step"] == 0 and results["ks"] == [1, 2, 4]
  for precision in ("fp4", "bf16"):
    assert {"pass@1", "pass@4", "mean@4", "greedy/pass@1"} <= set(results["precisions"][precision])
  records = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
  assert len(records) == 2 * RUN["eval_size"]
  assert all(len(r["samples"]["rewards"]) == 4 for r in records)
  table = capsys.readouterr().out.splitlines()[1:5]
  assert table[0] == (
    "| precision | greedy/reward | greedy/pass@1 | pass@1 | pass@2 | pass@4 | mean@4 |"
  )
  assert [row.split(" | ")[0] for row in table[2:]] == ["| fp4", "| bf16"]
  cells = [cell for row in table[2:] for cell in row.strip("| ").split(" | ")[1:]]
  assert all(re.fullmatch(r"\d\.\d{3} ± \d\.\d{3}", cell) for cell in cells), cells
  assert table == (out / "results.md").read_text().splitlines()[2:6]


def test_the_figures_are_the_per_problem_records_counted_by_hand(run):
  """With a task whose scorer solves about half the samples (an even sum of character
  codes), each
  precision's pass@k is the mean over problems of the k-subset share of its samples, and
  mean@n the mean reward, both read back from the records."""
  saved = SavedRun(run)
  task = policy_source.preflight(saved.config)

  class EvenLength(type(task)):
    def score(self, item, completion):
      return float(sum(map(ord, completion)) % 2 == 0)

  task.__class__ = EvenLength
  settings = EvalSettings(samples=3, ks=(1, 3), precisions=("bf16",))
  figures, records = evaluation.evaluate_policy(
    saved.policy, saved.config, task, saved.source, settings, progress=False
  )
  solved = [[r == 1.0 for r in record["samples"]["rewards"]] for record in records]
  assert 0 < sum(map(sum, solved)) < 3 * len(solved)  # some solved, some not
  for k in (1, 3):
    want = np.mean([_pass_at_k_by_subsets(s, k) for s in solved])
    assert figures["bf16"][f"pass@{k}"] == pytest.approx(want)
  assert figures["bf16"]["mean@3"] == pytest.approx(np.mean(solved))
  greedy = [float(sum(map(ord, r["greedy"]["response"])) % 2 == 0) for r in records]
  assert figures["bf16"]["greedy/reward"] == pytest.approx(np.mean(greedy))
  assert math.isfinite(figures["bf16"]["pass@3_se"])


def test_bad_requests_are_refused_before_any_weight_is_read(run, tmp_path):
  before = _hashes(run)
  for kwargs, match in [
    (dict(out=os.path.join(run, "evals")), r"lies inside the run's workdir"),
    (dict(step=7), r"step=7: workdir .* holds the checkpoints of steps \[0\]"),
    (dict(overrides={"eval_size": 0}), r"eval_size=0: use a whole number >= 1"),
    (dict(overrides={"temperature": -1.0}), r"RLConfig\.temperature=-1\.0"),
    (dict(overrides={"seed": 3}), r"an evaluation may set only"),
    (dict(hf_checkpoint=run), r"exactly one"),
  ]:
    with pytest.raises(ValueError, match=match):
      evaluation.evaluate(**{"workdir": run, "out": str(tmp_path / "new"), **kwargs})
    assert not (tmp_path / "new").exists()
  occupied = tmp_path / "occupied"
  occupied.mkdir()
  (occupied / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match=r"exists and is not an empty folder"):
    evaluation.evaluate(workdir=run, out=str(occupied))
  with pytest.raises(ValueError, match=r"hf_checkpoint needs a task"):
    evaluation.evaluate(hf_checkpoint=os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_moe"))
  assert _hashes(run) == before


def test_the_script_refuses_a_bad_flag_in_one_line(run, tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      f"--workdir={run}",
      "--samples=2",
      "--k=4",
      f"--out={tmp_path / 'out'}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
    "eval.py: error: k=[4]: each k of pass@k must be a whole number from 1 to samples=2, each once"
  ]
  assert not (tmp_path / "out").exists()
