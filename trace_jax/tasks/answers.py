"""Answers of free-text completions: where the answer is, and whether it matches a reference.

Two rewards, both in {0, 1}, neither raising on any completion:

  math   math-verify (`parse`, `verify`): the answer and the reference are parsed into sympy
         and compared as values, so "\\frac{1}{2}", "0.5" and "1/2" agree, as do "1,000"
         and "1000".
  exact  the answer and the reference after `normalize` (case, spacing, a trailing period,
         enclosing $...$ and \\boxed{...}) are the same string.

Where the answer is (`extract_answer`): after the last "####" (GSM8K's convention), else the
last \\boxed{...} (MATH's), else after the last '#' (the built-in tasks'), else the whole
completion. Only the last `MAX_COMPLETION_CHARS` of a completion are read and an answer past
`MAX_ANSWER_CHARS` scores 0, so a huge completion costs no more than a short one.

math-verify never executes model text: LaTeX goes through latex2sympy's own parser, and its
plain-expression path hands sympy's `parse_expr` only strings of digits, spaces, '.' and
arithmetic operators (its regex admits nothing else). What can take long is evaluating what
was parsed (a power tower such as 9**9**9**9): math-verify bounds parsing and comparing with a
SIGALRM time limit, which only the main thread can set. Off the main thread (asynchronous
rollouts score in a worker thread) the limit is unavailable, so answers holding a power,
factorial or binomial ('^', '**', '!', \\binom, \\choose) are compared by `exact` there.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

MAX_COMPLETION_CHARS = 4_000  # the tail of a completion that is searched for its answer
MAX_ANSWER_CHARS = 400  # an extracted answer longer than this scores 0
TIME_LIMIT_S = 2  # math-verify's parsing and comparing limit, each (main thread only)
REWARDS = ("math", "exact")
_SLOW = re.compile(r"\^|\*\*|!|\\binom|\\choose|\\dbinom|\\tbinom")


def last_boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None
  if there is none or it is not closed."""
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  brace = text.find("{", start)
  if brace < 0:
    return None
  depth = 0
  for i in range(brace, len(text)):
    if text[i] == "{":
      depth += 1
    elif text[i] == "}":
      depth -= 1
      if depth == 0:
        return text[brace + 1 : i]
  return None


def extract_answer(text: str, hash_mark: bool = True) -> str:
  """The answer part of a completion or a reference solution (see the module docstring);
  `hash_mark`=False: a lone '#' is part of the answer (a reference such as "C#")."""
  text = text[-MAX_COMPLETION_CHARS:]
  if "####" in text:
    return text.rsplit("####", 1)[1].strip()
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed.strip()
  if hash_mark and "#" in text:
    return text.rsplit("#", 1)[1].strip()
  return text.strip()


def normalize(answer: str) -> str:
  """Lower case, single spaces, no trailing period, no enclosing $...$ or \\boxed{...}."""
  text = answer.strip()
  boxed = last_boxed(text)
  if boxed is not None and text.startswith(("\\boxed", "\\fbox")):
    text = boxed
  text = text.strip().strip("$").strip().rstrip(".").strip()
  return " ".join(text.lower().split())


def exact_match(answer: str, references) -> float:
  """1.0 if the normalised answer equals a normalised reference, else 0.0."""
  mine = normalize(answer)
  return 1.0 if mine and any(mine == normalize(r) for r in references) else 0.0


def _latex(text: str) -> str:
  """Text math-verify reads as LaTeX: bare LaTeX ("\\frac{1}{2}", "\\sqrt{2}") is wrapped in
  $...$; text with its own delimiters or \\boxed stays as it is."""
  if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
    return text
  return f"${text}$"


@functools.lru_cache(maxsize=65_536)
def _parsed_reference(reference: str, limited: bool):
  from math_verify import parse

  return parse(_latex(reference), parsing_timeout=TIME_LIMIT_S if limited else None)


def _quiet() -> None:
  """math-verify logs a warning on every call without a time limit and on every timeout (a
  policy's completions would flood the log); its errors still show."""
  for name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(name).setLevel(logging.ERROR)


def math_match(answer: str, references) -> float:
  """1.0 if math-verify finds the answer equal to a reference, else 0.0; never raises."""
  try:
    from math_verify import parse, verify

    _quiet()

    limited = threading.current_thread() is threading.main_thread()
    if not limited and (_SLOW.search(answer) or any(_SLOW.search(r) for r in references)):
      return exact_match(answer, references)
    timeout = TIME_LIMIT_S if limited else None
    # bare LaTeX ("\\sqrt 2" out of a box) as LaTeX (read plainly it is 2); the rest as
    # written ("so it is 1/2": in $...$ its words would be variables)
    mine = parse(_latex(answer) if "\\" in answer else answer, parsing_timeout=timeout)
    if not mine:
      return exact_match(answer, references)
    for reference in references:
      gold = _parsed_reference(reference, limited)
      if gold and verify(gold, mine, timeout_seconds=TIME_LIMIT_S if limited else None):
        return 1.0
    return exact_match(answer, references)
  except BaseException as e:  # noqa: BLE001 - the scorer never raises on model text
    if isinstance(e, KeyboardInterrupt):
      raise
    return 0.0


def score(completion, references, reward: str) -> float:
  """The reward (`REWARDS`) of `completion` against the reference answers; 0.0 for anything
  that is not a string, has no answer, or whose answer is past `MAX_ANSWER_CHARS`."""
  try:
    if not isinstance(completion, str):
      return 0.0
    answer = extract_answer(completion)
    if not answer or len(answer) > MAX_ANSWER_CHARS:
      return 0.0
    if reward == "math":
      return math_match(answer, references)
    return exact_match(answer, references)
  except Exception:  # noqa: BLE001 - the scorer never raises on model text
    return 0.0
