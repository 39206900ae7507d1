"""A policy evaluated alone: a run's checkpoint or a Hugging Face checkpoint, on a task,
greedy and sampled, in FP4 and in bf16 (`experiments/eval.py`).

1. The problems are the run's evaluation problems (`Task.evaluation_items` with the run's
   evaluation seed and eval_size), played by the engines the run evaluates with (its greedy
   `RolloutConfig` in each precision, the same key, `rl.episodes.play` and the task's
   scorer): a checkpoint's greedy reward here is the one the run logged at that step.
2. Greedy: one sequence per problem -> the mean reward and greedy pass@1 (the share of
   problems solved, reward 1).
3. Sampled (samples n >= 1): n sequences per problem at the run's temperature, played as n
   batches of all the problems (the greedy batch's shape) with keys fold_in(seed, j) ->
   per problem, c of n solved -> pass@k for each k by the unbiased estimator of Chen et al.
   (2021, `pass_at_k`), and mean@n, the mean reward of all n (an unbiased estimate of the
   mean reward of k samples, for every k <= n).
4. Each figure comes with its standard error across problems (sample std / sqrt(problems):
   the problems as a sample of the task's); with one problem there is none (NaN, written
   as null, printed as nothing).

Nothing is written to the run: its checkpoint is read as the export reads it
(`export.run.SavedRun`: read-only, no lock taken, so a run in progress can be evaluated),
and every result goes to a folder of its own, which may not lie inside the run's workdir or
the checkpoint's directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from trace_jax.model.quant import PRECISIONS
from trace_jax.export.run import SavedRun, check_step, config_from_meta, open_checkpoints
from trace_jax.rl import data, episodes
from trace_jax.rl.config import RLConfig
from trace_jax.rl.sync import WeightSync
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.run import policy_source
from trace_jax.tasks.base import prompt_text
from trace_jax.utils import lock, markdown_table, write_atomic, write_json

log = logging.getLogger(__name__)

# RLConfig fields an evaluation may set (by flat name); the rest are the run's
OVERRIDABLE = ("task", "task_options", "eval_size", "max_new_tokens", "temperature")
RESULTS, TABLE, PROBLEMS = "results.json", "results.md", "problems.jsonl"


def _whole(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def pass_at_k(n: int, c: int, k: int) -> float:
  """The chance that k of n samples, drawn without replacement, hold at least one of the c
  correct ones: 1 - C(n - c, k) / C(n, k), the unbiased estimator of pass@k from n samples
  (Chen et al. 2021). Computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i), which never
  forms a binomial (C(2000, 1000) ~ 2e600 overflows a float64) and is exact for c = 0 and n - c < k.
  """
  if not (_whole(n) and _whole(c) and _whole(k)) or not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(
      f"pass_at_k(n={n!r}, c={c!r}, k={k!r}): need integers 0 <= c <= n, 1 <= k <= n"
    )
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def default_ks(samples: int) -> tuple[int, ...]:
  """1, 2, 4, ... up to `samples`, and `samples` itself; none for 0 samples."""
  ks = [2**i for i in range(max(samples, 1).bit_length()) if 2**i <= samples]
  return tuple(ks + ([samples] if samples and samples not in ks else []))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSettings:
  """What an evaluation computes besides the greedy pass."""

  samples: int = 0  # sampled sequences per problem (n); 0: greedy only
  ks: tuple = ()  # pass@k's k, each in [1, samples]; (): `default_ks(samples)`
  precisions: tuple = ("fp4", "bf16")  # rollout precisions (of `PRECISIONS`), each once
  seed: int = 0  # the samples' key

  def __post_init__(self):
    if not _whole(self.samples) or self.samples < 0:
      raise ValueError(
        f"samples={self.samples!r}: use a whole number >= 0 (sampled sequences per "
        "problem; 0: greedy only)"
      )
    ks = tuple(self.ks)
    bad = [k for k in ks if not _whole(k) or not 1 <= k <= self.samples]
    if ks and not self.samples:
      raise ValueError(f"k={list(ks)}: pass@k needs sampled answers; use samples >= 1")
    if bad or len(set(ks)) != len(ks):
      raise ValueError(
        f"k={list(ks)}: each k of pass@k must be a whole number from 1 to "
        f"samples={self.samples}, each once"
      )
    object.__setattr__(self, "ks", tuple(sorted(ks)) or default_ks(self.samples))
    precisions = tuple(self.precisions)
    if (
      not precisions or len(set(precisions)) != len(precisions) or set(precisions) - set(PRECISIONS)
    ):
      raise ValueError(
        f"precisions={','.join(map(str, precisions))!r}: use one or both of "
        f"{','.join(PRECISIONS)}, each once"
      )
    object.__setattr__(self, "precisions", precisions)
    if not _whole(self.seed):
      raise ValueError(f"seed={self.seed!r}: use a whole number")


def _figures(values, name: str) -> dict:
  """{name: the mean, name_se: its standard error across problems}."""
  values = np.asarray(values, np.float64)
  return {name: float(np.mean(values)), f"{name}_se": episodes.standard_error(values)}


def _number(value: float) -> float | None:
  """A JSON number: NaN (a reward of non-finite logits) as null."""
  return float(value) if math.isfinite(value) else None


def _responses(played: episodes.Episodes, multi_turn: bool) -> list:
  """Each sequence's response: its text, or the list of its turns' actions (multi-turn)."""
  return [actions if multi_turn else actions[0] for actions in played.actions]


def evaluate_policy(
  policy,
  config: RLConfig,
  task,
  source: policy_source.PolicySource,
  settings: EvalSettings,
  *,
  mesh=None,
  progress: bool = True,
) -> tuple[dict, list[dict]]:
  """(figures by precision, one record per precision and problem) of `policy` on the
  evaluation problems of `config` (module docstring, steps 1-4)."""
  items = task.evaluation_items(data.eval_seed(config.seed), config.evaluation.eval_size)
  if not items:
    raise ValueError(f"task {config.task!r} gave no evaluation problems (eval_size=0)")
  base, greedy = episodes.rollout_configs(config, task, source)
  sampled = base.replace(guidance="none", record_routing=False)  # plain samples, no capture
  tokenizer, sync = source.tokenizer, WeightSync()
  figures, records = {}, []
  bar = tqdm(
    total=len(settings.precisions) * (1 + settings.samples),
    desc="eval",
    disable=not progress,
    leave=False,
  )
  with bar:
    for precision in settings.precisions:
      engine = sync.add(RolloutEngine(policy, greedy.replace(precision=precision), mesh=mesh), 0)
      played = episodes.play(engine, task, tokenizer, items, jax.random.key(0))
      greedy_rewards = episodes.finite_rewards(played)
      greedy_responses = _responses(played, task.multi_turn)
      bar.update()
      rewards = np.zeros((len(items), settings.samples), np.float32)  # [problems, samples]
      responses = [[] for _ in items]
      if settings.samples:
        sampler = sync.add(
          RolloutEngine(policy, sampled.replace(precision=precision), mesh=mesh), 0
        )
        key = jax.random.key(settings.seed)
        for j in range(settings.samples):
          played = episodes.play(sampler, task, tokenizer, items, jax.random.fold_in(key, j))
          rewards[:, j] = episodes.finite_rewards(played)
          for i, response in enumerate(_responses(played, task.multi_turn)):
            responses[i].append(response)
          bar.update()
      solved = (rewards >= 1.0).sum(axis=1)  # NaN (non-finite logits) never solves
      passes = {k: [pass_at_k(settings.samples, int(c), k) for c in solved] for k in settings.ks}
      out = {
        **_figures(greedy_rewards, "greedy/reward"),
        **_figures(greedy_rewards >= 1.0, "greedy/pass@1"),
      }
      for k in settings.ks:
        out.update(_figures(passes[k], f"pass@{k}"))
      if settings.samples:
        out.update(_figures(rewards.mean(axis=1), f"mean@{settings.samples}"))
      figures[precision] = out
      for i, item in enumerate(items):
        record = {
          "precision": precision,
          "problem": i,
          "prompt": prompt_text(item.prompt),
          "target": item.target,
          "greedy": {"reward": _number(greedy_rewards[i]), "response": greedy_responses[i]},
        }
        if settings.samples:
          record["samples"] = {
            "rewards": [_number(r) for r in rewards[i]],
            "solved": int(solved[i]),
            **{f"pass@{k}": passes[k][i] for k in settings.ks},
            "responses": responses[i],
          }
        records.append(record)
  return figures, records


def _name(text: str) -> str:
  """`text` as one path component (a task such as dataset:/data/x.jsonl included)."""
  return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[-80:] or "x"


def default_out(source_name: str, task: str, step: int | None) -> str:
  """evals/<run or checkpoint>[-step<N>]-<task>-<time>, beside the runs/ rl.py makes."""
  at = "" if step is None else f"-step{step}"
  return os.path.join(
    "evals", f"{_name(source_name)}{at}-{_name(task)}-{time.strftime('%Y%m%d-%H%M%S')}"
  )


def check_out(out: str, protected: str, what: str) -> str:
  """The absolute output folder, made now and empty; a ValueError if it is, or lies
  inside, `protected` (the run's workdir or the checkpoint read: `what`), holds anything,
  is not a folder, or cannot be written."""
  path, guarded = os.path.realpath(out), os.path.realpath(protected)
  if path == guarded or path.startswith(guarded + os.sep):
    raise ValueError(
      f"out={out!r} lies inside {what} {protected!r}; an evaluation never writes there: "
      "use a folder outside it (leave --out unset for evals/...)"
    )
  if os.path.lexists(path) and (not os.path.isdir(path) or os.listdir(path)):
    raise ValueError(f"out={out!r} exists and is not an empty folder; use a new one")
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write_test.{os.getpid()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"out={out!r} cannot be written: {e.strerror or e}") from e
  return path


def _config(workdir, step, hf_checkpoint, overrides: dict) -> tuple[RLConfig, int | None]:
  """The evaluation's RLConfig (the run's, or a checkpoint's defaults, with `overrides`)
  and the run's step to read, checked without reading a weight."""
  unknown = sorted(set(overrides) - set(OVERRIDABLE))
  if unknown:
    raise ValueError(f"overrides {unknown}: an evaluation may set only {list(OVERRIDABLE)}")
  if (workdir is None) == (hf_checkpoint is None):
    raise ValueError(
      "evaluate a run (workdir) or a Hugging Face checkpoint (hf_checkpoint): exactly one"
    )
  if workdir is None:
    if step is not None:
      raise ValueError(f"step={step!r} reads a run's checkpoint: it needs a workdir")
    if not overrides.get("task"):
      raise ValueError("hf_checkpoint needs a task: which problems to evaluate it on")
    config = RLConfig.from_flat(hf_checkpoint=hf_checkpoint, **overrides)
  else:
    if not os.path.isdir(workdir):
      raise ValueError(f"workdir={workdir!r} does not exist (a run's folder: rl.py --workdir)")
    checkpoints = open_checkpoints(workdir)
    if step is None:
      step = checkpoints.latest_step()
    check_step(checkpoints, workdir, step)
    config = config_from_meta(checkpoints.read_meta(step)["config"])
    if "task" in overrides:  # the run's task options are its task's
      overrides = {"task_options": (), **overrides}
    config = config.replace(**overrides)
  # the evaluation runs on this machine's devices, whatever the run's groups were
  config = config.replace(rollout_devices=0)
  if config.evaluation.eval_size < 1:
    raise ValueError(f"eval_size={config.evaluation.eval_size}: use a whole number >= 1")
  return config, step


def evaluate(
  *,
  workdir: str | None = None,
  step: int | None = None,
  hf_checkpoint: str | None = None,
  out: str | None = None,
  settings: EvalSettings = EvalSettings(),
  overrides: dict | None = None,
  progress: bool = True,
) -> dict:
  """Evaluate a run's checkpoint (`workdir`, at `step`, default the latest) or the Hugging
  Face checkpoint `hf_checkpoint` on the run's task (or `overrides["task"]`, which a
  checkpoint needs), and write results.json, results.md and problems.jsonl into `out`
  (default `default_out`). Returns results.json's contents.

  Raises:
    ValueError: before any weight is read, for a bad setting, step or output folder.
  """
  config, step = _config(workdir, step, hf_checkpoint, dict(overrides or {}))
  task = policy_source.preflight(config)
  checked = policy_source.check(config, task)
  policy_source.check_fits(config, task, checked)
  protected, what = (workdir, "the run's workdir") if workdir else (hf_checkpoint, "the checkpoint")
  name = os.path.basename(os.path.normpath(os.path.abspath(protected)))
  out = out or default_out(name, config.task, step)
  made = not os.path.lexists(out)
  out = check_out(out, protected, what)
  try:
    return _evaluate(config, task, checked, workdir, step, out, settings, progress)
  except BaseException:
    if made and not os.listdir(out):  # nothing written: no empty folder left behind
      os.rmdir(out)
    raise


def _evaluate(config, task, checked, workdir, step, out, settings, progress) -> dict:
  """`evaluate` once everything is checked: read the policy, play, write."""
  start = time.time()
  if workdir is not None:
    if lock.current_holder(workdir) is not None:
      log.warning("workdir %s is in use by a run: evaluating its checkpoint step %d", workdir, step)
    run = SavedRun(workdir, step=step)
    policy, source, mesh = run.policy, run.source, run.mesh
  else:
    source = policy_source.load(config, task, checked=checked)
    policy, mesh = source.policy, None
  figures, records = evaluate_policy(
    policy, config, task, source, settings, mesh=mesh, progress=progress
  )
  results = {
    "workdir": None if workdir is None else os.path.abspath(workdir),
    "step": step,
    "hf_checkpoint": config.source.hf_checkpoint or None,
    "task": config.task,
    "task_options": [list(kv) for kv in config.task_options],
    "problems": len(records) // len(settings.precisions),
    "samples": settings.samples,
    "ks": list(settings.ks),
    "seed": settings.seed,
    "temperature": config.sampling.temperature,
    "max_new_tokens": config.sampling.max_new_tokens,
    "precisions": figures,
    "seconds": time.time() - start,
    "out": out,
    "config": config.to_dict(),
  }
  write_json(os.path.join(out, RESULTS), results)
  lines = "".join(json.dumps(r, default=repr) + "\n" for r in records)
  write_atomic(os.path.join(out, PROBLEMS), lines)
  write_atomic(os.path.join(out, TABLE), describe(results) + "\n\n" + table(results) + "\n")
  return results


def figure(value, se=None, digits: int = 3) -> str:
  """A rounded figure with its standard error: "0.500 ± 0.125"; only the figure where the
  error is None or NaN (one problem); "nan" for a NaN figure."""
  if value is None or not math.isfinite(value):
    return "nan"
  if se is None or not math.isfinite(se):
    return f"{value:.{digits}f}"
  return f"{value:.{digits}f} ± {se:.{digits}f}"


def table(results: dict) -> str:
  """The figures as a markdown table, one row per precision."""
  ks, samples = results["ks"], results["samples"]
  names = ["greedy/reward", "greedy/pass@1"] + [f"pass@{k}" for k in ks]
  names += [f"mean@{samples}"] if samples else []
  rows = [
    [precision] + [figure(figures[n], figures[f"{n}_se"]) for n in names]
    for precision, figures in results["precisions"].items()
  ]
  return markdown_table(["precision"] + names, rows)


def describe(results: dict) -> str:
  """One line: what was evaluated, on what, how."""
  if results["workdir"]:
    what = f"{results['workdir']} step {results['step']}"
  else:
    what = results["hf_checkpoint"]
  sampled = (
    f"{results['samples']} samples per problem at temperature {results['temperature']:g}"
    if results["samples"]
    else "greedy only"
  )
  problems = f"{results['problems']} problem{'s' if results['problems'] != 1 else ''}"
  return (
    f"{what} on {results['task']}: {problems}, {sampled}, "
    f"max_new_tokens {results['max_new_tokens']}, {results['seconds']:.0f} s"
  )
