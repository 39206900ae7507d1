"""`dataset:PATH` tasks: formats, column styles, splits, rewards, refusals, a short run."""

import json
import os
import random
import string
import subprocess
import sys

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("math_verify")

from math_verify import parse, verify  # noqa: E402

from trace_jax.rl import data  # noqa: E402
from trace_jax.rl.config import RLConfig  # noqa: E402
from trace_jax.tasks import answers  # noqa: E402
from trace_jax.tasks.chat import CheckpointTokenizer  # noqa: E402
from trace_jax.tasks.registry import get_task  # noqa: E402
from trace_jax.tasks.tokenizer import CharTokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "datasets")
HF = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_moe")


def fixture(name):
  return os.path.join(FIXTURES, name)


def rows_of(name):
  with open(fixture(name)) as f:
    return [json.loads(line) for line in f]


def write_jsonl(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


# --- loading ------------------------------------------------------------------------------------


def test_gsm8k_style_reads_the_answer_after_the_marks():
  task = get_task(f"dataset:{fixture('gsm8k_style.jsonl')}")
  rows = rows_of("gsm8k_style.jsonl")
  listed = task.problems("train")
  assert [it.prompt for it in listed] == [r["question"] for r in rows]
  assert [it.target for it in listed] == [(r["answer"].split("####")[1].strip(),) for r in rows]
  assert {it.meta["reward"] for it in listed} == {"math"}
  assert not task.has_demonstrations  # question/answer only: the warm start is skipped


def test_math_style_reads_the_last_box_and_demonstrates_the_solution():
  task = get_task(f"dataset:{fixture('math_style.jsonl')}")
  for item, row in zip(task.problems("train"), rows_of("math_style.jsonl")):
    numerator, denominator = row["problem"][len("What is ") : -1].split("/")
    assert item.target == (f"\\frac{{{numerator}}}{{{denominator}}}",)
    assert item.demonstration == row["solution"]
    assert task.score(item, item.demonstration) == 1.0
  assert task.has_demonstrations


@pytest.mark.parametrize("name", ["verl_style.jsonl", "verl_style.parquet"])
def test_verl_style_in_both_formats(name):
  task = get_task(f"dataset:{fixture(name)}")
  rows = rows_of("verl_style.jsonl")  # the Parquet file holds the same rows
  listed = task.problems("train")
  assert [it.prompt for it in listed] == [tuple(r["prompt"]) for r in rows]
  assert [it.target for it in listed] == [(r["reward_model"]["ground_truth"],) for r in rows]
  assert [it.meta["reward"] for it in listed] == [
    "math" if "gsm8k" in r["data_source"] else "exact" for r in rows
  ]
  assert [it.demonstration for it in listed] == [r["response"] for r in rows]


def test_parquet_and_jsonl_give_the_same_problems():
  jsonl = get_task(f"dataset:{fixture('gsm8k_style.jsonl')}").problems("train")
  parquet = get_task(f"dataset:{fixture('gsm8k_style.parquet')}").problems("train")
  assert [(a.prompt, a.target) for a in jsonl] == [(b.prompt, b.target) for b in parquet]


def test_columns_map_other_names_with_semicolons_or_commas():
  for columns in ("prompt:q;answer:a", "prompt:q,answer:a"):
    task = get_task(f"dataset:{fixture('custom_columns.jsonl')}", columns=columns)
    assert [(it.prompt, it.target) for it in task.problems("train")] == [
      (r["q"], (r["a"],)) for r in rows_of("custom_columns.jsonl")
    ]
    assert {it.meta["reward"] for it in task.problems("train")} == {"exact"}


def test_sampling_is_deterministic_and_draws_the_split():
  task = get_task(f"dataset:{fixture('gsm8k_style.jsonl')}", eval_share=0.25)
  assert task.sample(3, 16) == task.sample(3, 16)
  assert task.sample(3, 16) != task.sample(4, 16)
  train = {it.prompt for it in task.problems("train")}
  assert {it.prompt for it in task.sample(5, 64)} <= train
  assert {it.prompt for it in task.sample(5, 64, split="eval")}.isdisjoint(train)


# --- splits -------------------------------------------------------------------------------------


def test_eval_share_holds_out_a_seeded_share_evaluated_whole():
  path = f"dataset:{fixture('gsm8k_style.jsonl')}"
  task = get_task(path, eval_share=0.25, seed=1)
  held, train = task.problems("eval"), task.problems("train")
  prompts = {r["question"] for r in rows_of("gsm8k_style.jsonl")}
  assert len({it.prompt for it in held}) == round(0.25 * len(prompts))
  assert {it.meta["row"] for it in held} | {it.meta["row"] for it in train} == set(range(1, 25))
  assert not {it.meta["row"] for it in held} & {it.meta["row"] for it in train}
  assert not {it.prompt for it in held} & {it.prompt for it in train}  # repeats stay together
  assert task.evaluation_items(seed=0, n=100) == held  # the whole split, each problem once
  other = get_task(path, eval_share=0.25, seed=2).problems("eval")
  assert {it.meta["row"] for it in other} != {it.meta["row"] for it in held}
  assert get_task(path, eval_share=0.25, seed=1).problems("eval") == held


def test_eval_path_is_the_held_out_split(tmp_path):
  rows = rows_of("gsm8k_style.jsonl")
  held = write_jsonl(tmp_path / "held.jsonl", rows[:5])
  task = get_task(f"dataset:{fixture('gsm8k_style.jsonl')}", eval_path=held)
  assert [it.prompt for it in task.problems("eval")] == [r["question"] for r in rows[:5]]
  assert len(task.problems("train")) == len(rows)
  assert len(task.evaluation_items(seed=0, n=3)) == 3


def test_without_a_split_both_are_the_file():
  task = get_task(f"dataset:{fixture('gsm8k_style.jsonl')}")
  assert task.problems("eval") == task.problems("train")


# --- rewards ------------------------------------------------------------------------------------

# (reference, answer): the same value written two ways, or two values
EQUIVALENT = [
  ("\\frac{1}{2}", "0.5"),
  ("\\frac{1}{2}", "1/2"),
  ("\\frac{1}{2}", "\\frac12"),
  ("0.5", "\\frac{1}{2}"),
  ("1000", "1,000"),
  ("1,000", "1000"),
  ("\\sqrt{2}", "\\sqrt 2"),
  ("72", "72"),
]
DIFFERENT = [
  ("\\frac{1}{2}", "0.25"),
  ("1000", "100"),
  ("72", "71"),
  ("\\sqrt{2}", "2"),
]
# where a completion may write its answer
WRAPPERS = ["#{}", "#### {}", "The sum is 9. #### {}", "so \\boxed{{{}}}", "x=3, \\boxed{{{}}}."]


@pytest.mark.parametrize("reference, answer", EQUIVALENT + DIFFERENT)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_math_reward_agrees_with_math_verify(reference, answer, wrapper):
  expected = float(verify(parse(f"${reference}$"), parse(f"${answer}$")))
  assert expected == (1.0 if (reference, answer) in EQUIVALENT else 0.0)
  assert answers.score(wrapper.format(answer), (reference,), "math") == expected


def test_math_reward_reads_a_plain_sentence_as_written():
  assert answers.score("so it is 1/2", ("\\frac{1}{2}",), "math") == 1.0
  assert answers.score("so it is 1/3", ("\\frac{1}{2}",), "math") == 0.0


def test_exact_reward_normalises_but_does_not_compute():
  assert answers.score("#  Blue Whale. ", ("blue whale",), "exact") == 1.0
  assert answers.score("\\boxed{Paris}", ("paris",), "exact") == 1.0
  assert answers.score("#0.5", ("\\frac{1}{2}",), "exact") == 0.0
  assert answers.score("#red", ("blue",), "exact") == 0.0


def test_the_scorer_gives_garbage_zero_and_never_raises():
  task = get_task(f"dataset:{fixture('verl_style.jsonl')}", reward="math")
  item = task.problems("train")[0]
  rng = random.Random(0)
  garbage = [
    "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 300))) for _ in range(100)
  ]
  garbage += [
    "",
    "#",
    "####",
    "\\boxed{",
    "\\boxed{}}}}",
    "$$$$",
    "\\frac{1}{0}",
    "#" + "9" * 100_000,
    "x" * 1_000_000,
    "\\boxed{" * 10_000,
    "#9**9**9**9",
    "#2^{2^{2^{2^{10}}}}",
    "#(" * 5_000,
    None,
    12,
    b"10",
  ]
  for completion in garbage:
    reward = task.score(item, completion)
    assert reward in (0.0, 1.0)
    if completion is None or not isinstance(completion, str):
      assert reward == 0.0
  assert task.score(item, "x" * 1_000_000) == 0.0
  assert task.score(item, "#" + item.target[0]) == 1.0


def test_math_reward_without_a_time_limit_off_the_main_thread():
  """Off the main thread the time limit cannot stop a long integer power in C: a power tower
  there is compared exactly (no hang), plain answers still by value."""
  import threading

  results = {}

  def work():
    results["tower"] = answers.score("#9**9**9**9", ("42",), "math")
    results["half"] = answers.score("#0.5", ("\\frac{1}{2}",), "math")

  thread = threading.Thread(target=work)
  thread.start()
  thread.join(timeout=30)
  assert not thread.is_alive()
  assert results == {"tower": 0.0, "half": 1.0}


def test_reward_option_forces_math_or_exact():
  path = f"dataset:{fixture('verl_style.jsonl')}"
  assert {it.meta["reward"] for it in get_task(path, reward="math").problems("train")} == {"math"}
  assert {it.meta["reward"] for it in get_task(path, reward="exact").problems("train")} == {"exact"}


# --- refusals -----------------------------------------------------------------------------------


def test_bad_input_is_named_before_any_work(tmp_path):
  good = rows_of("gsm8k_style.jsonl")[:3]
  cases = [
    (str(tmp_path / "missing.jsonl"), {}, "missing.jsonl does not exist"),
    (write_jsonl(tmp_path / "a.csv", good), {}, "unknown format '.csv'"),
    (
      write_jsonl(tmp_path / "noprompt.jsonl", good + [{"answer": "#### 3"}]),
      {},
      "line 4: question",
    ),
    (
      write_jsonl(tmp_path / "noanswer.jsonl", good + [{"question": "2+2?", "answer": ""}]),
      {},
      "line 4: answer",
    ),
    (
      write_jsonl(tmp_path / "badjson.jsonl", [good[0], "{not json"]),
      {},
      "line 2 is not JSON",
    ),
    (write_jsonl(tmp_path / "empty.jsonl", []), {}, "has no rows"),
    (write_jsonl(tmp_path / "other.jsonl", [{"x": 1, "y": 2}]), {}, "no prompt column"),
    (fixture("custom_columns.jsonl"), {"columns": "prompt:q;answer:nope"}, "'nope', which is"),
    (fixture("custom_columns.jsonl"), {"columns": "question:q"}, "unknown role 'question'"),
    (fixture("custom_columns.jsonl"), {"columns": "prompt"}, "is not role:column"),
    (fixture("gsm8k_style.jsonl"), {"eval_share": 0.01}, "the eval split is empty"),
    (fixture("gsm8k_style.jsonl"), {"eval_share": 0.99}, "the train split is empty"),
    (fixture("gsm8k_style.jsonl"), {"eval_share": 1.5}, "eval_share=1.5"),
    (fixture("gsm8k_style.jsonl"), {"eval_path": str(tmp_path / "nope.jsonl")}, "nope.jsonl"),
    (fixture("gsm8k_style.jsonl"), {"reward": "fuzzy"}, "reward='fuzzy'"),
    (fixture("gsm8k_style.jsonl"), {"shuffle": 1}, "no option 'shuffle'"),
  ]
  for path, options, message in cases:
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(".", "\\.")):
      get_task(f"dataset:{path}", **options)


def test_a_bad_parquet_row_names_its_row(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  rows = rows_of("verl_style.jsonl")[:4]
  rows[2]["reward_model"]["ground_truth"] = None
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
  with pytest.raises(ValueError, match="row 3: reward_model.ground_truth"):
    get_task(f"dataset:{tmp_path / 'bad.parquet'}")


def test_config_accepts_dataset_tasks_without_reading_them():
  RLConfig.from_flat(task="dataset:/nowhere/at/all.jsonl")  # validation reads no file
  with pytest.raises(ValueError, match="names no file"):
    RLConfig.from_flat(task="dataset:")


# --- prompts ------------------------------------------------------------------------------------


def test_conversation_prompts_render_raw_and_through_the_chat_template():
  task = get_task(f"dataset:{fixture('verl_style.jsonl')}")
  item = task.problems("train")[0]
  (message,) = item.prompt
  char = CharTokenizer()
  assert data.prompt_ids(char, item) == [char.bos_id] + char.encode(message["content"])
  chat = CheckpointTokenizer(HF)
  as_text = chat.prompt_ids(message["content"])  # a string prompt is one user message
  assert data.prompt_ids(chat, item) == as_text
  system = CheckpointTokenizer(HF, system_prompt="Answer after #.")
  assert data.prompt_ids(system, item) == system.prompt_ids(message["content"])
  own = ({"role": "system", "content": "Be brief."}, message)
  rendered = system.prompt_text(own)  # a conversation's own system message stays
  assert "Be brief." in rendered and "Answer after #." not in rendered
  raw = CheckpointTokenizer(HF, prompt_format="raw")
  assert raw.prompt_text(own) == "Be brief.\n" + message["content"]


def test_the_episode_cache_holds_the_longest_prompt(tmp_path):
  from trace_jax.rl import episodes

  rows = [{"question": f"{i}+1?", "answer": f"#### {i + 1}"} for i in range(300)]
  rows[211] = {"question": "What is " + "one plus " * 12 + "one?", "answer": "#### 13"}
  task = get_task(f"dataset:{write_jsonl(tmp_path / 'long.jsonl', rows)}")
  char = CharTokenizer()
  longest = max(len(data.prompt_ids(char, it)) for it in task.problems("train"))
  assert longest == 1 + len(rows[211]["question"])
  assert rows[211]["question"] in [it.prompt for it in task.prompt_probe()]
  config = _run_config(f"dataset:{tmp_path / 'long.jsonl'}")
  max_len, _ = episodes.episode_len(config, task, char, observation_len=8)
  assert max_len >= longest + config.sampling.max_new_tokens


def test_a_comma_in_a_task_option_is_named():
  from trace_jax.utils import flags

  with pytest.raises(ValueError, match="comma"):  # --task_options=columns=prompt:q,answer:a
    flags.parse_pairs("task_options", ["columns=prompt:q", "answer:a"])
  assert flags.parse_pairs("task_options", ["columns=prompt:q;answer:a"]) == (
    ("columns", "prompt:q;answer:a"),
  )


# --- a run --------------------------------------------------------------------------------------


def _run_config(task, **overrides):
  base = dict(
    task=task,
    preset="tiny",
    steps=1,
    prompts_per_step=2,
    group_size=4,
    minibatches=2,
    max_new_tokens=8,
    sft_steps=2,
    sft_batch=4,
    eval_size=4,
    eval_every=1,
    checkpoint_every=1,
  )
  return RLConfig.from_flat(**{**base, **overrides})


@pytest.mark.slow
def test_trainer_runs_a_dataset_task(tmp_path):
  from trace_jax.run.rundir import read_metrics
  from trace_jax.run.trainer import Trainer

  config = _run_config(
    f"dataset:{fixture('gsm8k_style.jsonl')}", task_options=(("eval_share", 0.25),)
  )
  with Trainer(config, str(tmp_path / "run"), progress=False) as trainer:
    assert trainer.warmstart["steps"] == 0 and "no demonstrations" in trainer.warmstart["skipped"]
    assert len(trainer.eval_items) == 4
    trainer.run()
  rows = read_metrics(str(tmp_path / "run"))
  assert any("rewards/mean" in row for row in rows)


def test_forcing_a_warm_start_without_demonstrations_is_refused(tmp_path):
  from trace_jax.run import policy_source

  config = _run_config(f"dataset:{fixture('gsm8k_style.jsonl')}", sft_warm_start=True)
  with pytest.raises(ValueError, match="no demonstrations"):
    policy_source.preflight(config)


@pytest.mark.slow
def test_the_script_runs_a_dataset_task(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "experiments", "rl.py"),
      "--preset=tiny",
      f"--task=dataset:{fixture('gsm8k_style.jsonl')}",
      "--steps=2",
      "--sft_steps=0",
      "--eval_every=0",
      f"--workdir={tmp_path / 'run'}",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env={**os.environ, "PYTHONPATH": ROOT},
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-2000:]
