"""The evaluation's problems: a listable held-out split whole and each problem
once; n distinct problems for a task whose space is vast."""

import itertools
import random
import zlib

import pytest

from trace_jax.tasks import get_task
from trace_jax.tasks.base import Item, Task


def test_chain_evaluates_every_held_out_problem_once():
  """Against the split's definition worked out here: a prompt is held out when its CRC-32
  falls in the lowest quarter of the 32-bit range; 6^4 four-term sums in all."""
  task = get_task("chain")
  held_out = {
    "+".join(map(str, v)) + "="
    for v in itertools.product(range(6), repeat=4)
    if zlib.crc32(("+".join(map(str, v)) + "=").encode()) < 2**30
  }
  items = task.evaluation_items(seed=3, n=512)  # n covers the split: all of it
  prompts = [item.prompt for item in items]
  assert len(prompts) == len(set(prompts)) == len(held_out)
  assert set(prompts) == held_out
  assert task.evaluation_items(seed=4, n=324) == items  # the whole split, whatever the seed
  part = task.evaluation_items(seed=4, n=100)  # fewer: distinct, from the split, by the seed
  assert len({item.prompt for item in part}) == 100 and all(item in items for item in part)
  assert part == task.evaluation_items(seed=4, n=100) != task.evaluation_items(seed=5, n=100)
  assert task.evaluation_items(seed=4, n=0) == []
  for item in items:
    assert item.target == sum(int(x) for x in item.prompt[:-1].split("+"))
    assert task.score(item, item.demonstration) == 1.0
  # sampled held-out problems are these very items (same target and demonstration)
  by_prompt = {item.prompt: item for item in items}
  for item in task.sample(11, 40, split="eval"):
    assert by_prompt[item.prompt] == item
  assert not held_out & {item.prompt for item in task.sample(12, 300, split="train")}


def test_arith_without_a_held_out_share_lists_all_its_problems():
  task = get_task("arith")  # two operands 0-9, + and -: 200 problems, no share held out
  items = task.evaluation_items(seed=0, n=200)
  assert len(items) == len({item.prompt for item in items}) == 200
  for item in items:
    a, op, b = item.prompt[0], item.prompt[1], item.prompt[2:-1]
    assert item.target == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_a_vast_space_is_not_listed():
  assert get_task("arith", terms=9, max_operand=9).problems("eval") is None
  assert get_task("coding").problems("eval") is None


def test_a_multi_turn_task_tells_problems_apart_by_target_too():
  """search's prompt is the same for every secret: its problems differ by their target."""
  task = get_task("search", bits=3, max_turns=5)
  items = task.evaluation_items(seed=2, n=6)
  assert len({repr(item.target) for item in items}) == 6


def test_a_vast_task_gives_n_distinct_problems_deterministically():
  task = get_task("coding")
  items = task.evaluation_items(seed=5, n=24)
  assert len({item.prompt for item in items}) == 24
  assert items == task.evaluation_items(seed=5, n=24)
  assert items == task.sample(5, 24, split="eval")  # no repeats: the seed's own draw


class _Dice(Task):
  """Six problems drawn with replacement: repeats are certain in a draw of 6."""

  name = "dice"

  def sample(self, seed, n, split="train"):
    rng = random.Random(seed)
    return [Item(prompt=str(rng.randint(1, 6)), target=0, demonstration="") for _ in range(n)]

  def score(self, item, completion):
    return 0.0


def test_repeats_are_replaced_by_distinct_problems_and_too_many_are_refused():
  task = _Dice()
  assert len({item.prompt for item in task.sample(0, 6, split="eval")}) < 6
  assert sorted(item.prompt for item in task.evaluation_items(seed=0, n=6)) == list("123456")
  with pytest.raises(ValueError, match="7 distinct evaluation problems"):
    task.evaluation_items(seed=0, n=7)
  with pytest.raises(ValueError, match="n=-1"):
    task.evaluation_items(seed=0, n=-1)
