"""`dataset:PATH` input checks: bytes, nesting, numbers and text a file may hold, references
no answer can match, slow references, and how the script reports a file's fault."""

import json
import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("math_verify")

from trace_jax.tasks import answers, dataset  # noqa: E402
from trace_jax.tasks.registry import get_task  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = [{"question": f"What is {i}+1?", "answer": f"so\n#### {i + 1}"} for i in range(3)]


def write_lines(path, lines):
  """A JSONL file of `lines`: dicts as JSON, str as they are, bytes as they are."""
  with open(path, "wb") as f:
    for line in lines:
      if isinstance(line, dict):
        line = json.dumps(line)
      f.write((line if isinstance(line, bytes) else line.encode("utf-8")) + b"\n")
  return f"dataset:{path}"


def refusal(name, **options) -> str:
  with pytest.raises(dataset.DatasetError) as caught:
    get_task(name, **options)
  return str(caught.value)


# --- bytes, nesting, numbers ---------------------------------------------------------------------


def test_a_byte_that_is_not_utf8_is_named_by_line(tmp_path):
  bad = json.dumps({"question": "What is 2+2?", "answer": "#### 4"}).encode()
  bad = bad.replace(b"2+2", b"2\xff2")
  message = refusal(write_lines(tmp_path / "bytes.jsonl", GOOD[:1] + [bad]))
  assert message.startswith(f"dataset: {tmp_path / 'bytes.jsonl'}: line 2 is not UTF-8")
  assert "byte 0xff at byte 24" in message


def test_a_byte_order_mark_is_read_as_utf8_sig(tmp_path):
  plain = get_task(write_lines(tmp_path / "plain.jsonl", GOOD))
  marked = tmp_path / "bom.jsonl"
  marked.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "plain.jsonl").read_bytes())
  task = get_task(f"dataset:{marked}")
  assert [(it.prompt, it.target) for it in task.problems("train")] == [
    (it.prompt, it.target) for it in plain.problems("train")
  ]
  # a mark later in the file is not a byte-order mark: that line is refused
  with pytest.raises(ValueError, match="line 2 is not JSON"):
    get_task(write_lines(tmp_path / "late.jsonl", [GOOD[0], "\ufeff" + json.dumps(GOOD[1])]))


def test_nesting_past_what_json_reads_is_named_by_line(tmp_path):
  deep = '{"question": "q", "answer": "#### 1", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
  message = refusal(write_lines(tmp_path / "deep.jsonl", GOOD + [deep]))
  assert message.startswith(f"dataset: {tmp_path / 'deep.jsonl'}: line 4 nests")


def test_a_nested_value_in_a_message_is_shown_short(tmp_path):
  nested = "[" * 500 + "]" * 500
  line = '{"prompt": "q", "reward_model": {"ground_truth": "1"}, "data_source": ' + nested + "}"
  message = refusal(write_lines(tmp_path / "source.jsonl", [line]))
  assert "line 1: data_source is [[[[...]]]]: a data source is a string" in message
  assert len(message) < 300


def test_an_integer_past_python_s_digit_limit(tmp_path):
  huge = "9" * 5_000
  line = '{"question": "q", "answer": ' + huge + "}"
  message = refusal(write_lines(tmp_path / "huge.jsonl", GOOD + [line]))
  assert "line 4: answer is 5,000 characters, past the 400 the scorer reads" in message
  # in a column the task does not read it is no fault
  unread = '{"question": "q", "answer": "#### 7", "id": ' + huge + "}"
  task = get_task(write_lines(tmp_path / "unread.jsonl", GOOD + [unread]))
  assert task.problems("train")[-1].target == ("7",)


# --- text a tokenizer cannot encode --------------------------------------------------------------


def test_a_lone_surrogate_is_refused_by_line_and_field(tmp_path):
  lone = '{"question": "What is 2+2? \\ud800", "answer": "#### 4"}'
  message = refusal(write_lines(tmp_path / "lone.jsonl", GOOD + [lone]))
  assert message.startswith(
    f"dataset: {tmp_path / 'lone.jsonl'}: line 4: question holds a lone surrogate '\\ud800' "
    "at character 14"
  )
  conversation = {
    "prompt": [{"role": "user", "content": "hi \udfff"}],
    "reward_model": {"ground_truth": "4"},
  }
  message = refusal(write_lines(tmp_path / "verl.jsonl", [json.dumps(conversation)]))
  assert "line 1: prompt[0].content holds a lone surrogate" in message
  response = {"question": "q", "answer": "#### 4", "response": "\ud800 #### 4"}
  message = refusal(write_lines(tmp_path / "response.jsonl", [json.dumps(response)]))
  assert "line 1: response holds a lone surrogate" in message
  # a pair of escapes is one character, and fine
  pair = '{"question": "smile \\ud83d\\ude00", "answer": "#### 4"}'
  task = get_task(write_lines(tmp_path / "pair.jsonl", [pair]))
  assert task.problems("train")[0].prompt == "smile \U0001f600"


# --- references no answer can match --------------------------------------------------------------


def test_non_finite_numbers_are_refused_naming_the_rows(tmp_path):
  lines = [json.dumps(GOOD[0]), '{"question": "a", "answer": NaN}']
  lines += ['{"question": "b", "answer": [3, Infinity]}', '{"question": "c", "answer": 1e999}']
  message = refusal(write_lines(tmp_path / "nan.jsonl", lines))
  assert "3 reference(s) that no answer can match" in message
  assert "line 2: answer is nan (not a finite number)" in message
  assert "line 3: answer is inf" in message and "line 4: answer is inf" in message


def test_a_non_finite_parquet_reference_names_its_row(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  table = pa.Table.from_pylist([{"q": "a", "a": 1.5}, {"q": "b", "a": float("nan")}])
  pq.write_table(table, tmp_path / "nan.parquet")
  message = refusal(f"dataset:{tmp_path / 'nan.parquet'}", columns="prompt:q;answer:a")
  assert "row 2: a is nan (not a finite number)" in message


def test_references_past_what_the_scorer_reads_are_refused(tmp_path):
  long = {"question": "q", "answer": "#### " + "x " * 250}
  empty = {"question": "r", "answer": "$.$"}
  message = refusal(write_lines(tmp_path / "long.jsonl", [GOOD[0], long, empty]))
  assert "line 2: answer is 499 characters, past the 400" in message
  assert "line 3: answer '$.$' normalises to nothing" in message
  # 400 characters is the limit itself: such a reference can be won
  fits = {"question": "q", "answer": "#### " + "y" * 400}
  task = get_task(write_lines(tmp_path / "fits.jsonl", [fits]))
  assert task.score(task.problems("train")[0], "#" + "y" * 400) == 1.0


def test_gsm8k_answers_without_their_marker(tmp_path):
  solution = {"question": "q", "answer": "2 and 2 make 4.\nSo it is 4."}
  bare = {"question": "r", "answer": "4"}
  message = refusal(write_lines(tmp_path / "unmarked.jsonl", GOOD + [solution, bare]))
  assert "2 reference(s)" in message
  assert "line 4: answer has no '####' and spans lines" in message
  assert "line 5: answer has no '####', which the file's other answers end with" in message
  # a file of bare one-line answers is taken as it is, and so is a \boxed{} answer
  boxed = {"question": "s", "answer": "so \\boxed{5}"}
  task = get_task(write_lines(tmp_path / "bare.jsonl", [bare, boxed]))
  assert [it.target for it in task.problems("train")] == [("4",), ("5",)]
  # columns= names the answer: GSM8K's convention is not assumed
  task = get_task(
    write_lines(tmp_path / "mapped.jsonl", [solution]), columns="prompt:question;answer:answer"
  )
  assert task.problems("train")[0].target == (solution["answer"],)


def test_many_unmatchable_rows_are_counted_after_five(tmp_path):
  lines = [json.dumps(GOOD[0])] + ['{"question": "a", "answer": NaN}'] * 8
  message = refusal(write_lines(tmp_path / "many.jsonl", lines))
  assert "8 reference(s)" in message and "line 6:" in message and "line 7:" not in message
  assert "and 3 more" in message


# --- slow references -----------------------------------------------------------------------------


def test_a_reference_too_slow_to_compare_is_reported_and_scored_exactly(
  tmp_path, monkeypatch, caplog
):
  monkeypatch.setattr(answers, "TIME_LIMIT_S", 0.3)
  rows = GOOD + [
    {"question": "tower", "answer": "\\boxed{9^{9^{9^9}}}"},
    {"question": "power", "answer": "#### 2^{10}"},
  ]
  with caplog.at_level(logging.WARNING, logger="trace_jax.tasks.dataset"):
    task = get_task(write_lines(tmp_path / "tower.jsonl", rows))
  items = task.problems("train")
  assert [it.meta["reward"] for it in items] == ["math"] * 3 + ["exact", "math"]
  (record,) = caplog.records
  assert "1 reference(s) take math-verify over 0.3 s" in record.getMessage()
  assert "(line 4)" in record.getMessage()
  assert task.score(items[3], "\\boxed{9^{9^{9^9}}}") == 1.0
  assert task.score(items[3], "#0") == 0.0
  assert task.score(items[4], "#1024") == 1.0


def test_unmeasured_slow_candidates_are_reported(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(dataset, "SLOW_CHECK_S", 0.0)
  rows = GOOD + [{"question": f"f{i}", "answer": f"#### {i}!"} for i in range(3)]
  with caplog.at_level(logging.WARNING, logger="trace_jax.tasks.dataset"):
    task = get_task(write_lines(tmp_path / "budget.jsonl", rows))
  assert "3 row(s) whose references may be slow" in caplog.records[-1].getMessage()
  assert {it.meta["reward"] for it in task.problems("train")} == {"math"}


# --- splits --------------------------------------------------------------------------------------


def test_a_split_emptied_by_repeated_prompts_says_so(tmp_path):
  rows = [{"question": "same", "answer": f"#### {i}"} for i in range(9)]
  name = write_lines(tmp_path / "repeats.jsonl", rows + [{"question": "other", "answer": "#### 1"}])
  message = refusal(name, eval_share=0.2)
  assert "the eval split is empty (eval_share=0.2 of 10 rows (2 distinct prompts" in message


# --- the script ---------------------------------------------------------------------------------


def test_the_script_names_a_file_s_fault_in_one_line(tmp_path):
  """A dataset file's fault is not a usage error: no flag help, one line, exit 1."""
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  not_parquet = tmp_path / "rows.parquet"
  not_parquet.write_text(json.dumps(GOOD[0]) + "\n")
  processes = [
    subprocess.Popen(
      [
        sys.executable,
        os.path.join(ROOT, "experiments", "rl.py"),
        "--preset=tiny",
        f"--task=dataset:{path}",
        f"--workdir={tmp_path / 'never'}",
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      cwd=ROOT,
      env={**os.environ, "PYTHONPATH": ROOT},
    )
    for path in (empty, not_parquet)
  ]
  expected = [
    f"rl.py: error: dataset: {empty} has no rows",
    f"rl.py: error: dataset: {not_parquet} does not read as Parquet",
  ]
  for process, line in zip(processes, expected):
    _, err = process.communicate(timeout=300)
    assert process.returncode == 1
    assert "flags:" not in err and "USAGE" not in err and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(line), err[-2000:]
  assert not (tmp_path / "never").exists()
