"""The coding task's interpreter: semantics against Python, and hostile completions."""

import random

import pytest

from trace_jax.tasks import coding, get_task


def _random_program(rng, depth=0):
  """(source, python function) built together, so the function is an independent oracle."""
  if depth > 3 or rng.random() < 0.3:
    if rng.random() < 0.5:
      return "x", lambda x: x
    c = rng.randint(0, 20)
    return str(c), lambda x: c
  op = rng.choice(["+", "-", "*", "/", "%", "min", "max", "if", "neg", "<"])
  (sa, fa), (sb, fb) = _random_program(rng, depth + 1), _random_program(rng, depth + 1)
  if op == "min":
    return f"min({sa},{sb})", lambda x: min(fa(x), fb(x))
  if op == "max":
    return f"max({sa},{sb})", lambda x: max(fa(x), fb(x))
  if op == "if":
    return f"({sa}<{sb}?{sa}:{sb})", lambda x: fa(x) if fa(x) < fb(x) else fb(x)
  if op == "neg":
    return f"-({sa})", lambda x: -fa(x)
  py = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    "<": lambda a, b: int(a < b),
  }[op]
  return f"({sa}{op}{sb})", lambda x: py(fa(x), fb(x))


def test_interpreter_matches_python_semantics():
  rng = random.Random(0)
  checked = 0
  for _ in range(300):
    source, fn = _random_program(rng, depth=1)
    for x in (0, 3, 7):
      try:
        want = fn(x) if len(source) <= coding.MAX_CHARS else None  # over the limit: refused
      except ZeroDivisionError:
        want = None
      assert coding.run(source, [x])[0] == want, source
      checked += want is not None
  assert checked > 400


def test_precedence_and_operators():
  assert coding.run("2+3*x", [4]) == [14]
  assert coding.run("(2+3)*x", [4]) == [20]
  assert coding.run("-7/2", [0]) == [-4]  # floor division
  assert coding.run("-7%3", [0]) == [2]  # Python modulo
  assert coding.run("x<3?1:x>5?2:3", [1, 4, 9]) == [1, 3, 2]
  assert coding.run("abs(x-10)+max(x,2)*min(x,3)", [0, 5]) == [10, 20]
  assert coding.run("x==2", [2, 3]) == [1, 0]


HOSTILE = [
  "__import__('os').system('rm -rf /')",
  "open('/etc/passwd').read()",
  "exec('import socket')",
  "x" * 10_000,
  "(" * 5_000 + "x" + ")" * 5_000,
  "-" * 5_000 + "x",
  "9" * 200 + "*" + "9" * 200,
  "99999999999*99999999999*99999999999",
  "x/0",
  "x%0",
  "1/(x-x)",
  "min(" * 200 + "x" + ",1)" * 200,
  "x**x**x**x",
  "lambda: 1",
  "\x00\x01\x02",
  "é+1",
  "x?x:",
  "",
  "   ",
  None,
  12345,
]


@pytest.mark.parametrize("completion", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_completions_score_zero_with_bounded_work(monkeypatch, completion):
  """Scores 0, and quickly in a machine-independent sense: the interpreter evaluates at most
  MAX_NODES nodes per hidden test (the parser refuses anything larger before running it)."""
  task = get_task("coding", level=3)
  item = task.sample(0, 1)[0]
  evaluated = [0]
  evaluate = coding.evaluate

  def counting(tree, x):
    evaluated[0] += 1
    return evaluate(tree, x)

  monkeypatch.setattr(coding, "evaluate", counting)
  assert task.score(item, completion) == 0.0
  assert evaluated[0] <= coding.MAX_NODES * len(item.target), evaluated[0]


def test_value_limit_stops_growth():
  # Repeated squaring stays under the source-length limit but would grow without bound.
  program = "x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x*x"
  assert coding.run(program, [1000]) == [None]
  assert coding.run(program, [1]) == [1]
