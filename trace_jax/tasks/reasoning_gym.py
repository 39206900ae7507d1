"""`rg:<name>`: any reasoning-gym task (procedural, offline) through the Task interface.

Needs the optional extra: pip install -e ".[rg]".

Guards:
- tasks whose scorer runs model text through Python `eval`/`exec` or sympy `parse_expr`
  (which calls eval) are refused: a policy's completion must never execute;
- reasoning-gym's default scorer gives partial credit to any answer that merely contains the
  oracle answer (len(oracle) / len(answer)), which a policy can farm by emitting many
  numbers; partial credit is dropped (score < 1 counts as 0) unless `partial_credit=True`.

Completions answer after a '#' (as in the built-in tasks): the text after the last '#' is
the answer, or the whole completion if it has none.
"""

from __future__ import annotations

from trace_jax.tasks.base import Item, Task, check_split

# Scorers that evaluate model text (checked in reasoning-gym 0.1.25's sources).
UNSAFE = {
  "intermediate_integration": "sympy parse_expr (eval) of the answer",
  "simple_integration": "sympy parse_expr (eval) of the answer",
  "polynomial_multiplication": "sympy parse_expr (eval) of the answer",
  "countdown": "sympy parse_expr (eval) of the answer",
  "puzzle24": "sympy parse_expr (eval) of the answer",
  "n_queens": "Python eval of the answer",
  "codeio": "executes code",
}


class ReasoningGymTask(Task):
  kind = "reasoning"

  def __init__(self, dataset: str, partial_credit: bool = False, **options):
    if dataset in UNSAFE:
      raise ValueError(f"rg:{dataset} is refused: its scorer uses {UNSAFE[dataset]} on model text")
    try:
      import reasoning_gym
    except ImportError as e:
      raise ImportError('rg:<name> tasks need reasoning-gym: pip install -e ".[rg]"') from e
    if dataset not in reasoning_gym.factory.DATASETS:
      raise ValueError(
        f"rg:{dataset} is not a reasoning-gym dataset; available: "
        f"{sorted(reasoning_gym.factory.DATASETS)}"
      )
    self._rg = reasoning_gym
    self.dataset, self.options, self.partial_credit = dataset, options, partial_credit
    self.name = f"rg:{dataset}"
    try:
      self._scorer = reasoning_gym.create_dataset(dataset, size=1, seed=0, **options)
    except TypeError as e:  # an unknown option: say which task and which option
      raise ValueError(f"rg:{dataset}: bad task option ({e})") from e

  def sample(self, seed: int, n: int, split: str = "train") -> list[Item]:
    check_split(self, split)  # the problem space is vast: the splits differ by seed only
    data = self._rg.create_dataset(self.dataset, size=n, seed=seed, **self.options)
    return [
      Item(
        prompt=entry["question"],
        target=entry,
        demonstration=f"#{entry['answer']}",
        meta={"dataset": self.dataset},
      )
      for entry in data
    ]

  def score(self, item: Item, completion: str) -> float:
    try:
      text = str(completion)
      answer = text.rsplit("#", 1)[-1].strip()
      reward = float(self._scorer.score_answer(answer=answer, entry=item.target))
      if not self.partial_credit and reward < 1.0:
        return 0.0
      return min(max(reward, 0.0), 1.0)
    except Exception:  # the scorer never raises on model text
      return 0.0
