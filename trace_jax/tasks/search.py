"""Long-horizon, multi-turn: find a hidden number by guessing, with feedback after each guess.

  prompt         "find n in 0-63"
  turn k         the policy guesses an integer ("32"); the environment answers
                 "<" (n is smaller), ">" (n is larger) or "=" (found; the episode ends)
  reward         1.0 if found within `max_turns` guesses, else 0.0. With `shaping=True`,
                 a found episode earns 1 - 0.05 * (guesses - 1), favouring short searches
                 (off by default).

Binary search on the midpoint needs up to bits + 1 guesses (7 for 0-63; most secrets take
five or more): episodes last many turns, with an observation between every two. The solver is binary search on the midpoint.
`score(item, text)` replays the integers in a transcript's actions, so a demonstration
(its guesses joined by spaces) scores 1.0.
"""

from __future__ import annotations

import dataclasses
import random
import re

from trace_jax.tasks.base import EnvStep, Item, Task, check_split

_INT = re.compile(r"-?\d+")


@dataclasses.dataclass(frozen=True)
class SearchState:
  secret: int
  guesses: int = 0
  done: bool = False


class Search(Task):
  name = "search"
  kind = "long-horizon"
  multi_turn = True

  def __init__(self, bits: int = 6, max_turns: int = 8, shaping: bool = False):
    if not isinstance(bits, int) or not 2 <= bits <= 12:
      raise ValueError(f"search: bits={bits!r} must be an int in [2, 12]")
    if not isinstance(max_turns, int) or max_turns < bits + 1:
      raise ValueError(
        f"search: max_turns={max_turns!r} must be >= bits + 1 = {bits + 1} "
        "(what binary search may need)"
      )
    self.bits, self.max_turns, self.shaping = bits, max_turns, shaping
    self.high = 2**bits - 1

  def sample(self, seed: int, n: int, split: str = "train") -> list[Item]:
    check_split(self, split)  # the problem space is vast: the splits differ by seed only
    rng = random.Random(f"{self.name}:{seed}")
    items = []
    for _ in range(n):
      secret = rng.randint(0, self.high)
      items.append(
        Item(
          prompt=f"find n in 0-{self.high}",
          target=secret,
          demonstration=self.solve(secret),
          meta={"bits": self.bits},
        )
      )
    return items

  def solve(self, secret: int) -> list[str]:
    lo, hi, guesses = 0, self.high, []
    while True:
      guess = (lo + hi) // 2
      guesses.append(str(guess))
      if guess == secret:
        return guesses
      lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)

  def reset(self, item: Item) -> SearchState:
    return SearchState(secret=int(item.target))

  def _reward(self, state: SearchState, found: bool) -> float:
    if not found:
      return 0.0
    return 1.0 - 0.05 * (state.guesses - 1) if self.shaping else 1.0

  def step(self, state: SearchState, action: str) -> tuple[SearchState, EnvStep]:
    if state.done:
      raise ValueError("search: the episode has ended; reset it")
    state = dataclasses.replace(state, guesses=state.guesses + 1)
    match = _INT.search(str(action))
    guess = int(match.group()) if match and len(match.group()) < 12 else None
    if guess == state.secret:
      state = dataclasses.replace(state, done=True)
      return state, EnvStep(observation="=", done=True, reward=self._reward(state, True))
    if state.guesses >= self.max_turns:
      state = dataclasses.replace(state, done=True)
      return state, EnvStep(observation="", done=True, reward=0.0)
    if guess is None:
      return state, EnvStep(observation="?", done=False, reward=0.0)
    return state, EnvStep(observation="<" if state.secret < guess else ">", done=False, reward=0.0)

  def score(self, item: Item, completion: str) -> float:
    """Replay the integers of a transcript's actions as guesses."""
    try:
      state = self.reset(item)
      for guess in _INT.findall(str(completion))[: self.max_turns]:
        state, result = self.step(state, guess)
        if result.done:
          return result.reward
      return 0.0
    except Exception:  # the scorer never raises on model text
      return 0.0
