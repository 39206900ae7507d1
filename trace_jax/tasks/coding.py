"""Coding: write a one-line program that maps x to f(x), checked on hidden inputs.

The prompt shows a few input/output pairs; the completion is a program in a tiny language
that our own interpreter runs on hidden inputs; the reward is the fraction it gets right.

  prompt         "f(1)=5;f(2)=8;f(4)=14;f(x)="
  demonstration  "3*x+2"

The language (no loops, no names but x, no I/O of any kind):

  expr  := cmp ('?' expr ':' expr)?            conditional: cmp != 0 ? a : b
  cmp   := sum (('<' | '>' | '<=' | '>=' | '==' | '!=') sum)?   1 or 0
  sum   := term (('+' | '-') term)*
  term  := unary (('*' | '/' | '%') unary)*     '/' floors, '%' is Python's modulo
  unary := '-' unary | atom
  atom  := integer | 'x' | '(' expr ')' | ('min' | 'max') '(' expr ',' expr ')' | 'abs(' expr ')'

Safety: the scorer never evaluates model text with Python; it parses it with the grammar
above, so nothing can reach files, processes or the network. Time and memory are bounded by
hard limits checked before and during evaluation: program length, nesting depth, node count
and the magnitude of every intermediate value (no exponentiation exists to blow them up).
Any violation, parse error or division by zero scores the test as failed; `score` never raises.
"""

from __future__ import annotations

import random
import re

from trace_jax.tasks.base import Item, Task, check_split

MAX_CHARS = 96
MAX_DEPTH = 24
MAX_NODES = 128
MAX_VALUE = 10**12
_TOKEN = re.compile(r"\s*(?:(\d+)|(x|min|max|abs)|(<=|>=|==|!=|[-+*/%()<>?:,]))")


class ProgramError(Exception):
  """A program that does not parse, exceeds a limit, or fails (division by zero)."""


def _tokenize(source: str) -> list[str]:
  if len(source) > MAX_CHARS:
    raise ProgramError(f"program longer than {MAX_CHARS} characters")
  tokens, pos = [], 0
  source = source.rstrip()
  while pos < len(source):
    match = _TOKEN.match(source, pos)
    if not match or match.end() == pos:
      raise ProgramError(f"unexpected character at {pos}")
    tokens.append(next(g for g in match.groups() if g is not None))
    pos = match.end()
  return tokens


class _Parser:
  """Recursive descent to a nested-tuple AST, with depth and size limits."""

  def __init__(self, tokens):
    self.tokens, self.pos, self.nodes = tokens, 0, 0

  def peek(self):
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self, expected=None):
    token = self.peek()
    if token is None or (expected is not None and token != expected):
      raise ProgramError(f"expected {expected or 'more'} at token {self.pos}")
    self.pos += 1
    return token

  def node(self, *parts):
    self.nodes += 1
    if self.nodes > MAX_NODES:
      raise ProgramError("program too large")
    return parts

  def parse(self):
    tree = self.expr(0)
    if self.peek() is not None:
      raise ProgramError(f"trailing input at token {self.pos}")
    return tree

  def expr(self, depth):
    if depth > MAX_DEPTH:
      raise ProgramError("program nested too deeply")
    condition = self.cmp(depth)
    if self.peek() == "?":
      self.take("?")
      yes = self.expr(depth + 1)
      self.take(":")
      no = self.expr(depth + 1)
      return self.node("if", condition, yes, no)
    return condition

  def cmp(self, depth):
    left = self.sum(depth)
    if self.peek() in ("<", ">", "<=", ">=", "==", "!="):
      op = self.take()
      return self.node(op, left, self.sum(depth))
    return left

  def sum(self, depth):
    left = self.term(depth)
    while self.peek() in ("+", "-"):
      op = self.take()
      left = self.node(op, left, self.term(depth))
    return left

  def term(self, depth):
    left = self.unary(depth)
    while self.peek() in ("*", "/", "%"):
      op = self.take()
      left = self.node(op, left, self.unary(depth))
    return left

  def unary(self, depth):
    if depth > MAX_DEPTH:
      raise ProgramError("program nested too deeply")
    if self.peek() == "-":
      self.take()
      return self.node("neg", self.unary(depth + 1))
    return self.atom(depth)

  def atom(self, depth):
    token = self.take()
    if token.isdigit():
      if len(token) > 12:
        raise ProgramError("integer literal too large")
      return self.node("int", int(token))
    if token == "x":
      return self.node("x")
    if token == "(":
      inner = self.expr(depth + 1)
      self.take(")")
      return inner
    if token in ("min", "max", "abs"):
      self.take("(")
      first = self.expr(depth + 1)
      if token == "abs":
        self.take(")")
        return self.node("abs", first)
      self.take(",")
      second = self.expr(depth + 1)
      self.take(")")
      return self.node(token, first, second)
    raise ProgramError(f"unexpected token {token!r}")


def parse(source: str):
  """The AST of a program, or ProgramError."""
  return _Parser(_tokenize(source)).parse()


def evaluate(tree, x: int) -> int:
  """Run an AST on input x (raises ProgramError on a failure or an out-of-range value)."""
  op = tree[0]
  if op == "int":
    value = tree[1]
  elif op == "x":
    value = x
  elif op == "neg":
    value = -evaluate(tree[1], x)
  elif op == "abs":
    value = abs(evaluate(tree[1], x))
  elif op == "if":
    value = evaluate(tree[2], x) if evaluate(tree[1], x) != 0 else evaluate(tree[3], x)
  else:
    a, b = evaluate(tree[1], x), evaluate(tree[2], x)
    if op in ("/", "%") and b == 0:
      raise ProgramError("division by zero")
    value = {
      "+": lambda: a + b,
      "-": lambda: a - b,
      "*": lambda: a * b,
      "/": lambda: a // b,
      "%": lambda: a % b,
      "min": lambda: min(a, b),
      "max": lambda: max(a, b),
      "<": lambda: int(a < b),
      ">": lambda: int(a > b),
      "<=": lambda: int(a <= b),
      ">=": lambda: int(a >= b),
      "==": lambda: int(a == b),
      "!=": lambda: int(a != b),
    }[op]()
  if abs(value) > MAX_VALUE:
    raise ProgramError("value out of range")
  return value


def run(source: str, inputs) -> list[int | None]:
  """Outputs of a program on each input; None where it fails. Never raises."""
  try:
    tree = parse(source)
  except ProgramError:
    return [None] * len(inputs)
  except RecursionError:
    return [None] * len(inputs)
  outputs = []
  for x in inputs:
    try:
      outputs.append(evaluate(tree, x))
    except (ProgramError, RecursionError):
      outputs.append(None)
  return outputs


# Program families by difficulty: each returns (source, python function).
def _family(level: int, rng: random.Random):
  a, b, c = rng.randint(2, 6), rng.randint(0, 9), rng.randint(2, 5)
  if level == 1:
    return f"{a}*x+{b}", lambda x: a * x + b
  if level == 2:
    kind = rng.randint(0, 2)
    if kind == 0:
      return f"x*x+{b}", lambda x: x * x + b
    if kind == 1:
      return f"x%{c}*{a}", lambda x: x % c * a
    return f"(x+{b})/{c}", lambda x: (x + b) // c
  t = rng.randint(3, 8)
  kind = rng.randint(0, 1)
  if kind == 0:
    return f"x<{t}?{a}*x:x+{b}", lambda x: a * x if x < t else x + b
  return f"max(x,{t})*{c}", lambda x: max(x, t) * c


class Coding(Task):
  name = "coding"
  kind = "coding"

  def __init__(self, level: int = 1, shown: int = 3, hidden: int = 6, max_input: int = 12):
    if level not in (1, 2, 3):
      raise ValueError(f"coding: level={level!r} must be 1, 2 or 3")
    if shown < 1 or hidden < 1 or max_input < shown + hidden - 1:
      raise ValueError(
        f"coding: need shown >= 1, hidden >= 1 and max_input >= shown + hidden - 1; "
        f"got shown={shown}, hidden={hidden}, max_input={max_input}"
      )
    self.level, self.shown, self.hidden, self.max_input = level, shown, hidden, max_input

  def sample(self, seed: int, n: int, split: str = "train") -> list[Item]:
    check_split(self, split)  # the problem space is vast: the splits differ by seed only
    rng = random.Random(f"{self.name}:{seed}")
    items = []
    for _ in range(n):
      source, fn = _family(self.level, rng)
      inputs = rng.sample(range(self.max_input + 1), self.shown + self.hidden)
      shown, hidden = sorted(inputs[: self.shown]), inputs[self.shown :]
      prompt = ";".join(f"f({x})={fn(x)}" for x in shown) + ";f(x)="
      items.append(
        Item(
          prompt=prompt,
          target=[(x, fn(x)) for x in hidden],
          demonstration=source,
          meta={"level": self.level},
        )
      )
    return items

  def score(self, item: Item, completion: str) -> float:
    try:
      tests = item.target
      outputs = run(str(completion).strip(), [x for x, _ in tests])
      return sum(out == want for out, (_, want) in zip(outputs, tests)) / len(tests)
    except Exception:  # the scorer never raises on model text
      return 0.0
