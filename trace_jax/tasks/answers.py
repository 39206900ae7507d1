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
was parsed (a power tower such as 9^{9^{9^9}} compared with a wrong answer). The whole
math-verify call of one score (parsing the answer, parsing and comparing each reference)
runs under one limit of `TIME_LIMIT_S` (`tasks.time_limit`); past it the answer is compared
by `exact`. On the main thread the limit interrupts anything; off it (asynchronous rollouts
score in a worker thread) it interrupts Python code but not one long integer power in C, so
there answers holding a power, factorial or binomial ('^', '**', '!', \\binom, \\choose)
are compared by `exact` instead. `too_slow` finds the references that run past the limit.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

from trace_jax.tasks import time_limit

MAX_COMPLETION_CHARS = 4_000  # the tail of a completion that is searched for its answer
MAX_ANSWER_CHARS = 400  # an extracted answer longer than this scores 0
TIME_LIMIT_S = 1.0  # the whole math-verify call of one score
REWARDS = ("math", "exact")
# what can reach a long integer computation in C (off the main thread: compared by exact)
_SLOW = re.compile(r"\^|\*\*|!|\\binom|\\choose|\\dbinom|\\tbinom")
# a power of a power (9^{9^9}, 2**3**4), a factorial, a binomial: what may make math-verify
# evaluate numbers of millions of digits when it compares with a wrong answer
_COSTLY = re.compile(r"\^[^+\-=,;]*\^|\*\*[^+\-=,;]*\*\*|!|\\binom|\\choose|\\dbinom|\\tbinom")


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


def extract_answer(
  text: str, hash_mark: bool = True, max_chars: int | None = MAX_COMPLETION_CHARS
) -> str:
  """The answer part of a completion or a reference solution (see the module docstring);
  `hash_mark`=False: a lone '#' is part of the answer (a reference such as "C#");
  `max_chars`: the tail that is searched (None: all of it, for a reference)."""
  if max_chars is not None:
    text = text[-max_chars:]
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
def _parsed_reference(reference: str):
  from math_verify import parse

  return parse(_latex(reference), parsing_timeout=None)


# Pairs that take math-verify's (and sympy's) first-use paths: each path costs 0.05-0.5 s
# the first time (lazy imports, caches), which would count against the first scores' limit.
_WARM_UP = (("1", "1"), ("2^{10}", "1024"), ("2^{2^3}", "0"), ("x^2", "3"), ("10!", "0"))
_warm_lock = threading.Lock()
_warm: list[bool] = []


def _warmed_up() -> None:
  """math-verify imported and its first-use paths taken, once per process, without a limit
  (the pairs are small)."""
  if _warm:
    return
  with _warm_lock:
    if not _warm:
      from math_verify import parse, verify

      _quiet()
      for reference, answer in _WARM_UP:
        verify(
          parse(_latex(reference), parsing_timeout=None),
          parse(answer, parsing_timeout=None),
          timeout_seconds=None,
        )
      _warm.append(True)


def _quiet() -> None:
  """math-verify logs a warning on every call without its own time limit (the limit is
  `time_limit`'s here, over the whole call); its errors still show."""
  for name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(name).setLevel(logging.ERROR)


def _verified(answer: str, references) -> bool | None:
  """Whether math-verify finds the answer equal to a reference; None if it cannot parse the
  answer."""
  from math_verify import parse, verify

  # bare LaTeX ("\\sqrt 2" out of a box) as LaTeX (read plainly it is 2); the rest as
  # written ("so it is 1/2": in $...$ its words would be variables)
  mine = parse(_latex(answer) if "\\" in answer else answer, parsing_timeout=None)
  if not mine:
    return None
  return any(
    (gold := _parsed_reference(reference)) and verify(gold, mine, timeout_seconds=None)
    for reference in references
  )


def math_match(answer: str, references) -> float:
  """1.0 if math-verify finds the answer equal to a reference within `TIME_LIMIT_S`, else
  `exact_match`'s verdict; never raises."""
  try:
    _warmed_up()  # before the limit starts: first uses are slow
    if threading.current_thread() is not threading.main_thread() and (
      _SLOW.search(answer) or any(_SLOW.search(r) for r in references)
    ):
      return exact_match(answer, references)
    try:
      if time_limit.call(TIME_LIMIT_S, _verified, answer, references):
        return 1.0
    except time_limit.TimeLimitExceeded:
      pass
    return exact_match(answer, references)
  except BaseException as e:  # noqa: BLE001 - the scorer never raises on model text
    if isinstance(e, KeyboardInterrupt):
      raise
    return 0.0


def costly(reference: str) -> bool:
  """Whether comparing with `reference` may take math-verify long: it holds a power of a
  power, a factorial or a binomial (a cheap test of the text; `too_slow` measures)."""
  return bool(_COSTLY.search(reference))


def too_slow(reference: str) -> bool:
  """Whether comparing a wrong answer ("0") with `reference` runs math-verify past
  `TIME_LIMIT_S` (every such score costs the whole limit); measured once per process. Call
  it on the main thread, where the limit interrupts anything (off it, a reference holding a
  power, factorial or binomial is not measured: the scorer compares those by exact there)."""
  if threading.current_thread() is not threading.main_thread() and _SLOW.search(reference):
    return False
  return _too_slow(reference, TIME_LIMIT_S)


@functools.lru_cache(maxsize=4096)
def _too_slow(reference: str, limit: float) -> bool:
  try:
    _warmed_up()
    time_limit.call(limit, _verified, "0", (reference,))
    return False
  except time_limit.TimeLimitExceeded:
    return True
  except Exception:  # noqa: BLE001 - a reference math-verify fails on is scored by exact
    return False


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
