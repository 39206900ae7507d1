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
Everything wrong with a file (missing, unreadable, a row without a prompt or an answer, an
unknown role or column, an empty split) is a ValueError naming the file, the line or row and
the field, raised when the task is built, before any work.
"""

from __future__ import annotations

import heapq
import json
import os
import random

from trace_jax.tasks import answers
from trace_jax.tasks.base import Item, Task, check_split

ROLES = ("prompt", "answer", "response", "data_source")
REWARDS = ("auto",) + answers.REWARDS
MATH_SOURCES = ("gsm8k", "math", "dapo", "aime")
FORMATS = (".jsonl", ".parquet")
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
    raise ValueError(f"dataset: {path}: unknown format {ext or '(no extension)'!r}; use {FORMATS}")
  if not os.path.isfile(path):
    raise ValueError(f"dataset: {path} does not exist (or is not a file)")
  if ext == ".jsonl":
    rows = []
    with open(path, encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"dataset: {path}: line {number} is not JSON ({e})") from None
        if not isinstance(row, dict):
          raise ValueError(f"dataset: {path}: line {number} is not a JSON object")
        rows.append((number, row))
    return rows, "line"
  try:
    import pyarrow.parquet as pq
  except ImportError as e:
    raise ImportError('dataset: Parquet files need pyarrow: pip install -e ".[data]"') from e
  try:
    schema = pq.read_schema(path)
    names = [n for n in schema.names if fields is None or n in fields]
    table = pq.read_table(path, columns=names)
  except Exception as e:  # noqa: BLE001 - pyarrow raises its own types
    raise ValueError(f"dataset: {path} does not read as Parquet ({type(e).__name__}: {e})") from e
  columns = {name: table.column(name).to_pylist() for name in names}
  rows = [(i + 1, {n: columns[n][i] for n in names}) for i in range(table.num_rows)]
  return rows, "row"


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
        raise ValueError(
          f"dataset: {self.path}: the {split} split is empty (eval_share={eval_share}, "
          f"{len(items)} rows); use another eval_share or more rows"
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
      raise ValueError(f"dataset: {path} has no rows")
    if names is None:
      style, roles, default = self._resolve(path, set(rows[0][1]), mapping)
    self._style = style
    if "response" in roles and not _has(rows[0][1], roles["response"]):
      del roles["response"]  # a first row without one: the file has no demonstrations
    getters = {role: _getter(column) for role, column in roles.items()}
    rewards: dict = {}  # data_source -> reward
    items = []
    for number, row in rows:
      items.append(self._item(path, unit, number, row, roles, getters, default, rewards))
    return items

  def _resolve(self, path: str, names: set[str], mapping: dict[str, str]):
    """The file's style, its roles -> columns, and its default reward."""
    style = next((s for s, (key, _, _) in STYLES.items() if key in names), None)
    roles = dict(STYLES[style][1]) if style else {}
    roles.update(mapping)
    for role in ("prompt", "answer"):
      if role not in roles:
        raise ValueError(
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
        raise ValueError(
          f"{where('response')} is {demonstration!r}: the column gives the demonstrations, "
          "so every row needs a non-empty string"
        )
    source = getters["data_source"](row) if "data_source" in getters else None
    key = source if isinstance(source, (str, type(None))) else repr(source)
    if key not in rewards:
      rewards[key] = self._reward_of(default, source)
    return Item(
      prompt=prompt,
      target=references,
      demonstration=demonstration,
      meta={"reward": rewards[key], "row": number, "data_source": source},
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


def _prompt(value, where, role: str):
  """A prompt: a non-empty string, or a tuple of {role, content} messages. where(role): the
  file, row and column, for a message."""
  if isinstance(value, str):
    if not value.strip():
      raise ValueError(f"{where(role)} is empty: every row needs a prompt")
    return value
  if isinstance(value, (list, tuple)) and value:
    messages = []
    for i, message in enumerate(value):
      if (
        not isinstance(message, dict)
        or not isinstance(message.get("role"), str)
        or not isinstance(message.get("content"), str)
      ):
        raise ValueError(
          f"{where(role)}[{i}] is {message!r}: a message is {{'role': str, 'content': str}}"
        )
      messages.append({"role": message["role"], "content": message["content"]})
    return tuple(messages)
  raise ValueError(
    f"{where(role)} is {value!r}: every row needs a prompt (a string or a list of messages)"
  )


def _references(value, where, role: str) -> tuple[str, ...]:
  """The reference answers: a string ("####" and \\boxed{} answers extracted), a number, or
  a list of them."""
  if isinstance(value, str):
    text = answers.extract_answer(value, hash_mark=False)
    if text:
      return (text,)
  values = value if isinstance(value, (list, tuple)) else [value]
  references = []
  for v in values:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
      continue
    text = answers.extract_answer(v, hash_mark=False) if isinstance(v, str) else str(v)
    if text:
      references.append(text)
  if not references:
    raise ValueError(
      f"{where(role)} is {value!r}: every row needs an answer (a string or a number)"
    )
  return tuple(references)
