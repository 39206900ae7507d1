"""`dataset:PATH`: problems from a JSONL or Parquet file, scored by their reference answers.

Column styles (found from the file's first row or schema; `columns=` maps other names):

  verl    prompt (a string, or a list of {role, content} messages), reward_model.ground_truth
          (a nested dict column), optional data_source, extra_info, response
  GSM8K   question, answer (the reference is what follows "####"; math reward)
  MATH    problem, solution (the reference is the last \\boxed{}; the solution is also the
          demonstration; math reward)

Options (`--task_options=key=value`, or `get_task("dataset:PATH", key=value)`):

  columns    role:column pairs separated by ';' (e.g. "prompt:q;answer:a"); roles: prompt,
             answer, response, data_source; a dotted column reads a nested field
             ("answer:reward_model.ground_truth"). Given roles replace the style's.
  eval_path  a second file (same columns): the held-out split; the first file is all training.
  eval_share a float in (0, 1): that share of the distinct prompts, chosen with `seed`, is
             held out (rows that repeat a prompt go with it).
             Neither: both splits are the whole file.
  seed       the eval_share split's seed (default 0).
  reward     "auto" (default: math for GSM8K/MATH styles and data_source values naming gsm8k,
             math, dapo or aime; else exact), "math" or "exact" (`tasks.answers`).

Demonstrations for the SFT warm start come from a `response` column (or MATH's solution);
a file without one has none (`has_demonstrations`), and the run skips its warm start.
Everything wrong with a file (missing, unreadable, not UTF-8, nested past what JSON reads,
a row without a prompt or an answer, text a tokenizer cannot encode, a reference no answer
can match, an empty split) is a `DatasetError` naming the file, the line or row and the
field, raised when the task is built, before any work; a wrong option is a ValueError. A
UTF-8 byte-order mark at the start of a JSONL file is skipped.

References that math-verify cannot compare with a wrong answer within its time limit
(`answers.too_slow`: a power tower such as 9^{9^{9^9}}) are scored by exact match instead
and logged as a warning naming their rows; only references that may be slow
(`answers.costly`) are measured, for at most `SLOW_CHECK_S` per file.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import random
import reprlib
import time

from trace_jax.tasks import answers
from trace_jax.tasks.base import Item, Task, check_split

ROLES = ("prompt", "answer", "response", "data_source")
REWARDS = ("auto",) + answers.REWARDS
MATH_SOURCES = ("gsm8k", "math", "dapo", "aime")
FORMATS = (".jsonl", ".parquet")
SLOW_CHECK_S = 3.0  # at most this long per file measuring references that may be slow
LISTED = 5  # rows named in a message about several
_SHORT = reprlib.Repr()  # a value in a message: a few levels, items and characters of it
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 3, 60, 60, 4, 4
_log = logging.getLogger(__name__)
_warned: set[str] = (
  set()
)  # warnings given: a file loaded twice (a script's check, then its run) warns once


class DatasetError(ValueError):
  """A fault of a dataset file (its contents, not an option's value): a script ends with its
  message alone, not with its usage."""


def _int(digits: str):
  """A JSON integer; one past Python's int-string limit (4300 digits) stays its digits."""
  try:
    return int(digits)
  except ValueError:
    return digits


_DECODER = json.JSONDecoder(parse_int=_int)
# column style: (the column that names it, its roles, its default reward)
STYLES = {
  "verl": (
    "prompt",
    {
      "prompt": "prompt",
      "answer": "reward_model.ground_truth",
      "response": "response",
      "data_source": "data_source",
    },
    None,
  ),
  "gsm8k": ("question", {"prompt": "question", "answer": "answer", "response": "response"}, "math"),
  "math": ("problem", {"prompt": "problem", "answer": "solution", "response": "solution"}, "math"),
}


def parse_columns(columns: str) -> dict[str, str]:
  """ "prompt:q;answer:a" -> {"prompt": "q", "answer": "a"}; a ValueError for anything else."""
  mapping = {}
  for pair in filter(None, (p.strip() for p in str(columns).replace(",", ";").split(";"))):
    role, sep, column = pair.partition(":")
    role, column = role.strip(), column.strip()
    if not sep or not column:
      raise ValueError(
        f"dataset: columns={columns!r}: {pair!r} is not role:column (e.g. columns=prompt:q;answer:a)"
      )
    if role not in ROLES:
      raise ValueError(f"dataset: columns={columns!r}: unknown role {role!r}; roles: {ROLES}")
    mapping[role] = column
  return mapping


def read_rows(path: str, fields: set[str] | None = None) -> tuple[list[dict], str]:
  """The rows of a JSONL or Parquet file, and what names a row in messages ("line", "row").

  fields: the top-level columns to read from a Parquet file (None: all)."""
  ext = os.path.splitext(path)[1].lower()
  if ext not in FORMATS:
    raise DatasetError(
      f"dataset: {path}: unknown format {ext or '(no extension)'!r}; use {FORMATS}"
    )
  if not os.path.isfile(path):
    raise DatasetError(f"dataset: {path} does not exist (or is not a file)")
  if ext == ".jsonl":
    return _read_jsonl(path), "line"
  try:
    import pyarrow.parquet as pq
  except ImportError as e:
    raise ImportError('dataset: Parquet files need pyarrow: pip install -e ".[data]"') from e
  try:
    schema = pq.read_schema(path)
    names = [n for n in schema.names if fields is None or n in fields]
    table = pq.read_table(path, columns=names)
    columns = {name: table.column(name).to_pylist() for name in names}
  except Exception as e:  # noqa: BLE001 - pyarrow raises its own types
    raise DatasetError(
      f"dataset: {path} does not read as Parquet ({type(e).__name__}: {str(e)[:200]})"
    ) from e
  rows = [(i + 1, {n: columns[n][i] for n in names}) for i in range(table.num_rows)]
  return rows, "row"


def _read_jsonl(path: str) -> list[tuple[int, dict]]:
  """(line number, object) of each non-blank line; a DatasetError naming the line for bytes
  that are not UTF-8, text that is not a JSON object, or nesting past what Python reads."""
  rows = []
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a byte-order mark (Windows tools write one)
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DatasetError(
          f"dataset: {path}: line {number} is not UTF-8 (byte 0x{raw[e.start]:02x} at byte "
          f"{e.start + 1} of the line); save the file as UTF-8"
        ) from None
      if not line.strip():
        continue
      try:
        row = _DECODER.decode(line)
      except RecursionError:
        raise DatasetError(
          f"dataset: {path}: line {number} nests lists or objects deeper than Python's JSON "
          "reader allows (about 1,000 levels)"
        ) from None
      except ValueError as e:  # json.JSONDecodeError among them
        raise DatasetError(f"dataset: {path}: line {number} is not JSON ({e})") from None
      if not isinstance(row, dict):
        raise DatasetError(
          f"dataset: {path}: line {number} is not a JSON object (it is a {type(row).__name__})"
        )
      rows.append((number, row))
  return rows


def _parquet_names(path: str) -> list[str] | None:
  if not path.lower().endswith(".parquet") or not os.path.isfile(path):
    return None
  try:
    import pyarrow.parquet as pq

    return list(pq.read_schema(path).names)
  except Exception:  # noqa: BLE001 - read_rows names what is wrong
    return None


def _get(row: dict, column: str):
  """row[column], a dotted column reading nested dicts; None where absent."""
  value = row
  for key in column.split("."):
    if not isinstance(value, dict) or key not in value:
      return None
    value = value[key]
  return value


def _has(row: dict, column: str) -> bool:
  return _get(row, column) is not None


class DatasetTask(Task):
  """Single-turn problems of a file (see the module docstring)."""

  kind = "reasoning"

  def __init__(
    self,
    path: str,
    columns: str = "",
    eval_path: str = "",
    eval_share: float = 0.0,
    seed: int = 0,
    reward: str = "auto",
  ):
    if not path:
      raise ValueError("dataset: the task needs a file: --task=dataset:PATH (.jsonl or .parquet)")
    if reward not in REWARDS:
      raise ValueError(f"dataset: reward={reward!r} is not one of {REWARDS}")
    if isinstance(eval_share, bool) or not isinstance(eval_share, (int, float)):
      raise ValueError(f"dataset: eval_share={eval_share!r} must be a number in (0, 1)")
    if eval_share and not 0.0 < eval_share < 1.0:
      raise ValueError(f"dataset: eval_share={eval_share!r} must be a number in (0, 1)")
    if eval_share and eval_path:
      raise ValueError(
        f"dataset: eval_path={eval_path!r} and eval_share={eval_share!r}: give one of them"
      )
    if isinstance(seed, bool) or not isinstance(seed, int):
      raise ValueError(f"dataset: seed={seed!r} must be an int")
    self.path, self.name, self.reward = str(path), f"dataset:{path}", reward
    mapping = parse_columns(columns) if columns else {}
    items = self._load(self.path, mapping)
    if eval_path:
      self._train, self._eval = items, self._load(str(eval_path), mapping)
    elif eval_share:
      # by distinct prompt: a prompt that repeats in the file falls wholly in one split
      prompts = list(dict.fromkeys(repr(it.prompt) for it in items))
      random.Random(f"dataset-split:{seed}").shuffle(prompts)
      held = set(prompts[: round(eval_share * len(prompts))])
      self._eval = [it for it in items if repr(it.prompt) in held]
      self._train = [it for it in items if repr(it.prompt) not in held]
    else:
      self._train = self._eval = items
    for split, listed in (("train", self._train), ("eval", self._eval)):
      if not listed:
        distinct = len({repr(it.prompt) for it in items})
        repeats = (
          f" ({distinct} distinct prompts: rows that repeat a prompt stay in one split)"
          if distinct < len(items)
          else ""
        )
        raise DatasetError(
          f"dataset: {self.path}: the {split} split is empty (eval_share={eval_share} of "
          f"{len(items)} rows{repeats}); use another eval_share or more rows"
        )
    self.has_demonstrations = all(it.demonstration is not None for it in self._train)
    self.style = self._style

  def _load(self, path: str, mapping: dict[str, str]) -> list[Item]:
    names = _parquet_names(path)
    fields = None
    if names is not None:
      style, roles, default = self._resolve(path, set(names), mapping)
      fields = {c.split(".")[0] for c in roles.values()}
    rows, unit = read_rows(path, fields)
    if not rows:
      raise DatasetError(f"dataset: {path} has no rows")
    if names is None:
      style, roles, default = self._resolve(path, set(rows[0][1]), mapping)
    self._style = style
    if "response" in roles and not _has(rows[0][1], roles["response"]):
      del roles["response"]  # a first row without one: the file has no demonstrations
    getters = {role: _getter(column) for role, column in roles.items()}
    rewards: dict = {}  # data_source -> reward
    items, unmatchable = [], []  # unmatchable: (row, why) of references no answer matches
    marked = style == "gsm8k" and "answer" not in mapping  # GSM8K's "####" answers
    unmarked, with_marks = [], 0  # rows of a GSM8K answer without "####" or \boxed{}
    for number, row in rows:
      item = self._item(path, unit, number, row, roles, getters, default, rewards)
      items.append(item)
      for why in _unmatchable(item.target):
        unmatchable.append((number, f"{roles['answer']} {why}"))
      answer = getters["answer"](row) if marked else None
      if not isinstance(answer, str):
        continue
      if "####" in answer:
        with_marks += 1
      elif answer.strip() == item.target[0]:  # neither "####" nor \boxed{}: taken whole
        if "\n" in item.target[0]:
          why = "has no '####' and spans lines: the whole solution would be the reference"
          unmatchable.append((number, f"{roles['answer']} {why}"))
        else:
          unmarked.append(number)
    if unmarked and with_marks:
      why = "has no '####', which the file's other answers end with"
      unmatchable.extend((number, f"{roles['answer']} {why}") for number in unmarked)
    if unmatchable:
      unmatchable.sort()
      named = "; ".join(f"{unit} {number}: {why}" for number, why in unmatchable[:LISTED])
      more = f"; and {len(unmatchable) - LISTED} more" if len(unmatchable) > LISTED else ""
      raise DatasetError(
        f"dataset: {path}: {len(unmatchable)} reference(s) that no answer can match: "
        f"{named}{more}; fix or drop these rows"
      )
    _score_slow_references_exactly(path, unit, items)
    return items

  def _resolve(self, path: str, names: set[str], mapping: dict[str, str]):
    """The file's style, its roles -> columns, and its default reward."""
    style = next((s for s, (key, _, _) in STYLES.items() if key in names), None)
    roles = dict(STYLES[style][1]) if style else {}
    roles.update(mapping)
    for role in ("prompt", "answer"):
      if role not in roles:
        raise DatasetError(
          f"dataset: {path}: no {role} column: the columns are {sorted(names)}; a file has "
          "prompt + reward_model.ground_truth (verl), question + answer (GSM8K) or problem + "
          "solution (MATH), or columns= maps them (e.g. columns=prompt:q;answer:a)"
        )
    for role, column in mapping.items():
      if column.split(".")[0] not in names:
        raise ValueError(
          f"dataset: {path}: columns= maps {role} to {column!r}, which is not a column; "
          f"the columns are {sorted(names)}"
        )
    for role in ("response", "data_source"):
      if role in roles and roles[role].split(".")[0] not in names:
        del roles[role]
    return style, roles, STYLES[style][2] if style and not mapping.get("answer") else None

  def _item(self, path, unit, number, row, roles, getters, default, rewards) -> Item:
    """One row's problem; `rewards` caches the reward of each data_source value."""

    def where(role: str) -> str:  # built only for a message: a file has many rows
      return f"dataset: {path}: {unit} {number}: {roles[role]}"

    prompt = _prompt(getters["prompt"](row), where, "prompt")
    references = _references(getters["answer"](row), where, "answer")
    demonstration = None
    if "response" in getters:
      demonstration = getters["response"](row)
      if not isinstance(demonstration, str) or not demonstration.strip():
        raise DatasetError(
          f"{where('response')} is {_SHORT.repr(demonstration)}: the column gives the "
          "demonstrations, so every row needs a non-empty string"
        )
      _check_text(demonstration, where, "response")
    source = getters["data_source"](row) if "data_source" in getters else None
    if source is not None and not isinstance(source, str):
      raise DatasetError(
        f"{where('data_source')} is {_SHORT.repr(source)}: a data source is a string "
        "(it chooses the reward) or absent"
      )
    if source not in rewards:
      rewards[source] = self._reward_of(default, source)
    return Item(
      prompt=prompt,
      target=references,
      demonstration=demonstration,
      meta={"reward": rewards[source], "row": number, "data_source": source, "file": path},
    )

  def _reward_of(self, default: str | None, source) -> str:
    if self.reward != "auto":
      return self.reward
    if default is not None:
      return default
    text = str(source or "").lower()
    return "math" if any(s in text for s in MATH_SOURCES) else "exact"

  def problems(self, split: str) -> list[Item]:
    """Every problem of the split, in the file's order."""
    check_split(self, split)
    return list(self._train if split == "train" else self._eval)

  def prompt_probe(self) -> list[Item]:
    """The 64 longest prompts of both splits, by characters (a conversation's, plus a
    template's scaffolding of about 32 characters per message): a file's prompts vary in
    length, and a run's cache must hold its longest. Tokens follow characters closely
    (exactly, for the character tokenizer), so the longest in tokens is among these."""

    def length(item: Item) -> int:
      if isinstance(item.prompt, str):
        return len(item.prompt)
      return sum(len(m["content"]) + 32 for m in item.prompt)

    return heapq.nlargest(64, self._train + self._eval, key=length)

  def origin(self, item: Item) -> str:
    """The file and the line (JSONL) or row (Parquet) of one of the task's problems."""
    path = item.meta["file"]
    unit = "row" if path.lower().endswith(".parquet") else "line"
    return f"{path}: {unit} {item.meta['row']}"

  def sample(self, seed: int, n: int, split: str = "train") -> list[Item]:
    check_split(self, split)
    listed = self._train if split == "train" else self._eval
    rng = random.Random(f"{self.name}:{split}:{seed}")
    return [listed[rng.randrange(len(listed))] for _ in range(n)]

  def score(self, item: Item, completion: str) -> float:
    try:
      return answers.score(completion, item.target, item.meta.get("reward", "exact"))
    except Exception:  # noqa: BLE001 - the scorer never raises on model text
      return 0.0


def _getter(column: str):
  """row -> row[column] (None where absent), a dotted column reading nested dicts."""
  if "." not in column:
    return lambda row: row.get(column)
  return lambda row: _get(row, column)


def _check_text(text: str, where, role: str) -> None:
  """A DatasetError if `text` holds a lone surrogate (JSON's "\\ud800" without its pair):
  Python keeps it in a string, but no tokenizer encodes it."""
  if text.isascii():
    return
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise DatasetError(
      f"{where(role)} holds a lone surrogate {text[e.start]!r} at character {e.start + 1} "
      "(a JSON \\ud800-\\udfff escape without its pair), which no tokenizer encodes"
    ) from None


def _prompt(value, where, role: str):
  """A prompt: a non-empty string, or a tuple of {role, content} messages. where(role): the
  file, row and column, for a message."""
  if isinstance(value, str):
    if not value.strip():
      raise DatasetError(f"{where(role)} is empty: every row needs a prompt")
    _check_text(value, where, role)
    return value
  if isinstance(value, (list, tuple)) and value:
    messages = []
    for i, message in enumerate(value):
      if (
        not isinstance(message, dict)
        or not isinstance(message.get("role"), str)
        or not isinstance(message.get("content"), str)
      ):
        raise DatasetError(
          f"{where(role)}[{i}] is {_SHORT.repr(message)}: a message is "
          "{'role': str, 'content': str}"
        )
      _check_text(message["role"], lambda r: f"{where(r)}[{i}].role", role)
      _check_text(message["content"], lambda r: f"{where(r)}[{i}].content", role)
      messages.append({"role": message["role"], "content": message["content"]})
    return tuple(messages)
  raise DatasetError(
    f"{where(role)} is {_SHORT.repr(value)}: every row needs a prompt (a string or a list "
    "of messages)"
  )


def _references(value, where, role: str) -> tuple:
  """The reference answers: a string ("####" and \\boxed{} answers extracted), a number, or
  a list of them. A non-finite number stays a float (`_unmatchable` names it)."""
  if isinstance(value, str):
    _check_text(value, where, role)
    text = answers.extract_answer(value, hash_mark=False, max_chars=None)
    if text:
      return (text,)
  values = value if isinstance(value, (list, tuple)) else [value]
  references = []
  for v in values:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
      continue
    if isinstance(v, float) and not math.isfinite(v):
      references.append(v)
      continue
    if isinstance(v, str):
      _check_text(v, where, role)
      text = answers.extract_answer(v, hash_mark=False, max_chars=None)
    else:
      text = str(v)
    if text:
      references.append(text)
  if not references:
    raise DatasetError(
      f"{where(role)} is {_SHORT.repr(value)}: every row needs an answer (a string or a number)"
    )
  return tuple(references)


def _unmatchable(references) -> list[str]:
  """Why each reference that no scored answer can match cannot be matched (`tasks.answers`:
  an answer past MAX_ANSWER_CHARS scores 0, and so does an empty one)."""
  found = []
  for reference in references:
    if isinstance(reference, float):
      found.append(f"is {reference} (not a finite number)")
      continue
    size = len(answers.normalize(reference))
    if size > answers.MAX_ANSWER_CHARS:
      found.append(
        f"is {size:,} characters, past the {answers.MAX_ANSWER_CHARS} the scorer reads of an answer"
      )
    elif not size:
      found.append(f"{reference!r} normalises to nothing (no answer matches an empty one)")
  return found


def _score_slow_references_exactly(path: str, unit: str, items: list[Item]) -> None:
  """Rows scored by math whose reference math-verify cannot compare with a wrong answer
  within its limit (`answers.too_slow`) are scored by exact match, and logged: each score
  would cost the whole limit. Only references `answers.costly` flags are measured, for
  `SLOW_CHECK_S` at most; the log says how many were left unmeasured."""
  candidates = [
    it for it in items if it.meta["reward"] == "math" and any(answers.costly(r) for r in it.target)
  ]
  if not candidates:
    return
  start, slow, unmeasured, verdicts = time.monotonic(), [], 0, {}
  for item in candidates:
    if time.monotonic() - start >= SLOW_CHECK_S:
      unmeasured += 1
      continue
    for reference in item.target:
      if reference not in verdicts:
        verdicts[reference] = answers.costly(reference) and answers.too_slow(reference)
    if any(verdicts[r] for r in item.target):
      item.meta["reward"] = "exact"
      slow.append(item.meta["row"])
  warnings = []
  if slow:
    named = ", ".join(str(row) for row in slow[:LISTED])
    more = f" and {len(slow) - LISTED} more" if len(slow) > LISTED else ""
    rows = unit + "s" if len(slow) > 1 else unit
    warnings.append(
      f"dataset: {path}: {len(slow)} reference(s) take math-verify over "
      f"{answers.TIME_LIMIT_S:g} s to compare with a wrong answer ({rows} {named}{more}); "
      "these rows are scored by exact match"
    )
  if unmeasured:
    warnings.append(
      f"dataset: {path}: {unmeasured} row(s) whose references may be slow to compare were "
      f"not measured (the {SLOW_CHECK_S:g} s budget ran out); each of their scores is "
      f"bounded by {answers.TIME_LIMIT_S:g} s"
    )
  for warning in warnings:
    if warning not in _warned:
      _warned.add(warning)
      _log.warning(warning)
