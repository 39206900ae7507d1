"""Reasoning: multi-step integer arithmetic, evaluated left to right, with an exact answer.

  prompt         "7+8-5+4="            (terms=4)
  demonstration  "7+8=15;15-5=10;10+4=14;#14"
  score          1.0 if the number after the last '#' equals the answer, else 0.0

Difficulty: `terms` (operands, >= 2: the chain has terms - 1 steps, each written out) and
`max_operand`. Two single-digit operands (the default) are 200 problems, each a fact of its
own; three or more terms make multi-step chains where one wrong digit anywhere costs the
reward, and whose few step facts are shared by many problems.

Held-out problems: with `eval_share` > 0 a fixed share of all problems (by a hash of the
prompt) is drawn only by `sample(..., split="eval")`, never for training (SFT or RL), so the
evaluation measures what carries over to problems the policy never saw. With 0 (the
default) both splits draw from every problem, by different seeds.

A flawed teacher: with `flawed_facts` > 0 a fixed share of the step facts ("3+4", by a hash,
the same on every machine) is one the teacher has wrong: each time such a step comes up in
a drawn demonstration, it is written one too high with probability `flaw_rate`, and the
teacher carries its own wrong sum on ("3+4=8;8+2=10;#10"). The item's target, and so the
reward, stays the true answer. SFT on these demonstrations learns the teacher's mistakes as
the likelier answer of those facts, with the right one still sampled (1 - `flaw_rate`): what
a verifiable reward can correct and imitation cannot. Listed problems (`problems`, the whole
evaluation split) carry the true solution as their demonstration.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
import zlib

from trace_jax.tasks.base import MAX_LISTED, Item, Task, check_split

_ANSWER = re.compile(r"#(-?\d+)")


class Arithmetic(Task):
  name = "arith"
  kind = "reasoning"

  def __init__(
    self,
    terms: int = 2,
    max_operand: int = 9,
    ops: str = "+-",
    eval_share: float = 0.0,
    flawed_facts: float = 0.0,
    flaw_rate: float = 0.0,
  ):
    if not isinstance(terms, int) or terms < 2:
      raise ValueError(f"arith: terms={terms!r} must be an int >= 2")
    if not isinstance(max_operand, int) or max_operand < 1:
      raise ValueError(f"arith: max_operand={max_operand!r} must be an int >= 1")
    if not ops or set(ops) - set("+-*"):
      raise ValueError(f"arith: ops={ops!r} must be a non-empty string over '+-*'")
    if not isinstance(eval_share, (int, float)) or not 0.0 <= eval_share < 1.0:
      raise ValueError(f"arith: eval_share={eval_share!r} must be a number in [0, 1)")
    for name, value in (("flawed_facts", flawed_facts), ("flaw_rate", flaw_rate)):
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"arith: {name}={value!r} must be a number in [0, 1]")
    self.terms, self.max_operand, self.ops = terms, max_operand, ops
    self.eval_share = float(eval_share)
    self.flawed_facts, self.flaw_rate = float(flawed_facts), float(flaw_rate)

  def split_of(self, prompt: str) -> str:
    """The split a problem belongs to: "eval" for a fixed share `eval_share` of prompts
    (by CRC-32, the same on every machine and Python), else "train"."""
    return "eval" if zlib.crc32(prompt.encode()) < self.eval_share * 2**32 else "train"

  def is_flawed(self, fact: str) -> bool:
    """Whether the teacher has the step fact `fact` ("3+4") wrong: a fixed share
    `flawed_facts` of facts, by SHA-256 (the same on every machine and Python; CRC-32, fine
    for whole prompts, clusters on strings this short)."""
    digest = hashlib.sha256(f"flawed:{fact}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < self.flawed_facts * 2**64

  def problems(self, split: str) -> list[Item] | None:
    """Every problem of the split in a fixed order (operands, then operators, ascending);
    None past `MAX_LISTED` problems."""
    check_split(self, split)
    operands, symbols = self.max_operand + 1, len(set(self.ops))
    if operands**self.terms * symbols ** (self.terms - 1) > MAX_LISTED:
      return None
    items = []
    for values in itertools.product(range(operands), repeat=self.terms):
      for ops in itertools.product(sorted(set(self.ops)), repeat=self.terms - 1):
        prompt = str(values[0]) + "".join(f"{o}{v}" for o, v in zip(ops, values[1:])) + "="
        if not self.eval_share or self.split_of(prompt) == split:
          items.append(self._item(prompt, values, ops))
    return items

  def _item(self, prompt: str, values, ops, teacher: random.Random | None = None) -> Item:
    """The problem, its true answer, and a demonstration: the true solution, or with
    `teacher` (the sampler's generator) and `flawed_facts` > 0 the flawed teacher's (its
    wrong facts one too high with probability `flaw_rate`, its own sums carried on)."""
    steps, acc, shown = [], values[0], values[0]
    for op, v in zip(ops, values[1:]):
      acc = _apply(acc, op, v)
      written = _apply(shown, op, v)
      fact = f"{shown}{op}{v}"
      # the draw only for a flawed fact: a task without flaws samples as it always did
      flawed = teacher is not None and self.flawed_facts > 0 and self.is_flawed(fact)
      if flawed and teacher.random() < self.flaw_rate:
        written += 1
      steps.append(f"{fact}={written}")
      shown = written
    return Item(
      prompt=prompt,
      target=acc,
      demonstration=";".join(steps) + f";#{shown}",
      meta={"terms": self.terms},
    )

  def sample(self, seed: int, n: int, split: str = "train") -> list[Item]:
    check_split(self, split)
    rng = random.Random(f"{self.name}:{seed}")
    items, draws = [], 0
    while len(items) < n:
      draws += 1
      if draws > 1_000 * (n + 10):  # eval_share=0.25 needs ~4 draws per item
        raise ValueError(
          f"arith: split={split!r} has no problems: eval_share={self.eval_share} "
          f"of these {self.terms}-term problems puts none there; use a larger "
          f"problem space or another eval_share"
        )
      values = [rng.randint(0, self.max_operand) for _ in range(self.terms)]
      ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
      prompt = str(values[0]) + "".join(f"{o}{v}" for o, v in zip(ops, values[1:])) + "="
      if self.eval_share and self.split_of(prompt) != split:
        continue
      items.append(self._item(prompt, values, ops, teacher=rng))
    return items

  def score(self, item: Item, completion: str) -> float:
    try:
      found = _ANSWER.findall(completion)
      return 1.0 if found and int(found[-1]) == int(item.target) else 0.0
    except Exception:  # a scorer never raises on model text
      return 0.0


def _apply(acc: int, op: str, v: int) -> int:
  return acc + v if op == "+" else acc - v if op == "-" else acc * v


class ArithmeticChain(Arithmetic):
  """Four-term sums of operands 0-5, worked out step by step, with a quarter of the 1,296
  problems held out for the evaluation (the main job's task before `chain_flawed`).

  prompt "3+5+0+4=", demonstration "3+5=8;8+0=8;8+4=12;#12". Its three step facts per
  problem come from a table of 96 that every problem shares, so what RL sharpens on the
  training problems carries over to the held-out ones. A `small` policy after a warm start
  of 150 SFT steps solves 0.66-0.84 of the held-out problems greedily, depending on the seed
  and the machine (0.37-0.43 after 100 steps: the SFT passes a sharp transition in between).
  """

  name = "chain"

  def __init__(
    self,
    terms: int = 4,
    max_operand: int = 5,
    ops: str = "+",
    eval_share: float = 0.25,
    flawed_facts: float = 0.0,
    flaw_rate: float = 0.0,
  ):
    super().__init__(
      terms=terms,
      max_operand=max_operand,
      ops=ops,
      eval_share=eval_share,
      flawed_facts=flawed_facts,
      flaw_rate=flaw_rate,
    )


class FlawedChain(ArithmeticChain):
  """The main job's task: `chain` taught by a flawed teacher. A fifth of the step facts
  (`flawed_facts=0.2`: 23 of the 96 that four-term sums of 0-5 use) are ones the teacher has
  wrong: in a drawn demonstration such a step is written one too high 60% of the time
  (`flaw_rate=0.6`), and carried on ("3+4=8;8+2=10;#10"). The reward and the held-out
  evaluation score the true sum; 68% of the held-out problems touch a flawed fact.

  Why: SFT on the clean `chain` passes a sharp transition whose step depends on the seed and
  the machine, so where RL started, and how much room it had, was the seed's draw (0.53-0.84
  greedily after the same warm start, gains from +0.03 to +0.23). Here imitation learns the
  teacher's mistakes as the likelier answers while the true one is still sampled about 40% of
  the time: a verifiable reward corrects what imitation cannot, and a greedy answer flips
  once its fact's true sum passes 50%, a small move. At rate 0.7 the same RL gained about
  +0.14 in 120-150 steps (the wrong answer's lead is twice as large); at 0.6, +0.23 to +0.26.
  """

  name = "chain_flawed"

  def __init__(
    self,
    terms: int = 4,
    max_operand: int = 5,
    ops: str = "+",
    eval_share: float = 0.25,
    flawed_facts: float = 0.2,
    flaw_rate: float = 0.6,
  ):
    super().__init__(
      terms=terms,
      max_operand=max_operand,
      ops=ops,
      eval_share=eval_share,
      flawed_facts=flawed_facts,
      flaw_rate=flaw_rate,
    )
