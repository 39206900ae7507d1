"""Reasoning: multi-step integer arithmetic, evaluated left to right, with an exact answer.

  prompt         "7+8-5+4="            (terms=4)
  demonstration  "7+8=15;15-5=10;10+4=14;#14"
  score          1.0 if the number after the last '#' equals the answer, else 0.0

Difficulty: `terms` (operands, >= 2: the chain has terms - 1 steps, each written out) and
`max_operand`. The default, two single-digit operands, is what a `small` CPU model learns
from a short SFT and then improves with RL in minutes; three or more terms make multi-step
chains where one wrong digit anywhere costs the reward.
"""

from __future__ import annotations

import random
import re

from trace_jax.tasks.base import Item, Task

_ANSWER = re.compile(r"#(-?\d+)")


class Arithmetic(Task):
  name = "arith"
  kind = "reasoning"

  def __init__(self, terms: int = 2, max_operand: int = 9, ops: str = "+-"):
    if not isinstance(terms, int) or terms < 2:
      raise ValueError(f"arith: terms={terms!r} must be an int >= 2")
    if not isinstance(max_operand, int) or max_operand < 1:
      raise ValueError(f"arith: max_operand={max_operand!r} must be an int >= 1")
    if not ops or set(ops) - set("+-*"):
      raise ValueError(f"arith: ops={ops!r} must be a non-empty string over '+-*'")
    self.terms, self.max_operand, self.ops = terms, max_operand, ops

  def sample(self, seed: int, n: int) -> list[Item]:
    rng = random.Random(f"{self.name}:{seed}")
    items = []
    for _ in range(n):
      values = [rng.randint(0, self.max_operand) for _ in range(self.terms)]
      ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
      prompt = str(values[0]) + "".join(f"{o}{v}" for o, v in zip(ops, values[1:])) + "="
      steps, acc = [], values[0]
      for op, v in zip(ops, values[1:]):
        new = acc + v if op == "+" else acc - v if op == "-" else acc * v
        steps.append(f"{acc}{op}{v}={new}")
        acc = new
      items.append(Item(prompt=prompt, target=acc, demonstration=";".join(steps) + f";#{acc}",
                        meta={"terms": self.terms}))
    return items

  def score(self, item: Item, completion: str) -> float:
    try:
      found = _ANSWER.findall(completion)
      return 1.0 if found and int(found[-1]) == int(item.target) else 0.0
    except Exception:  # a scorer never raises on model text
      return 0.0
