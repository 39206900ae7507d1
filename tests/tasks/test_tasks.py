"""Tasks: solvers score 1.0, wrong answers less, determinism, the multi-turn environment."""

import numpy as np
import pytest

from trace_jax.tasks import get_task, registered

SINGLE_TURN = [
  ("arith", {}),
  ("arith", {"terms": 4, "max_operand": 50, "ops": "+-*"}),
  ("chain", {}),
  ("coding", {"level": 1}),
  ("coding", {"level": 2}),
  ("coding", {"level": 3}),
]


@pytest.mark.parametrize("name, options", SINGLE_TURN)
def test_solver_scores_one_and_wrong_answers_less(name, options):
  task = get_task(name, **options)
  items = task.sample(3, 40)
  for item in items:
    assert task.score(item, item.demonstration) == 1.0
    assert task.score(item, "") == 0.0
  wrong = {
    "arith": lambda i: f"#{i.target + 1}",
    "chain": lambda i: f"#{i.target + 1}",
    "coding": lambda i: i.demonstration + "+1",
  }[name]
  assert all(task.score(item, wrong(item)) < 1.0 for item in items)


def test_sampling_is_deterministic_per_seed():
  for name in ("arith", "coding", "search"):
    task = get_task(name)
    assert task.sample(5, 10) == task.sample(5, 10)
    assert task.sample(5, 10) != task.sample(6, 10)


def test_arith_reads_the_last_answer():
  task = get_task("arith")
  item = task.sample(0, 1)[0]
  assert task.score(item, f"#{item.target + 3};#{item.target}") == 1.0
  assert task.score(item, f"#{item.target};#{item.target + 3}") == 0.0


def test_coding_partial_credit_is_the_fraction_of_hidden_tests():
  task = get_task("coding", level=3, hidden=6)
  item = task.sample(0, 1)[0]
  tests = item.target
  # A piecewise-constant program right on exactly the hidden inputs it names.
  right_on = tests[:2]
  program = (
    "x=="
    + str(right_on[0][0])
    + "?"
    + str(right_on[0][1])
    + ":(x=="
    + str(right_on[1][0])
    + "?"
    + str(right_on[1][1])
    + ":-1)"
  )
  expected = sum(1 for x, y in tests if (y == -1 or (x, y) in right_on)) / 6
  assert task.score(item, program) == pytest.approx(expected)


def test_search_environment():
  task = get_task("search")
  item = task.sample(0, 1)[0]
  state = task.reset(item)
  observations = []
  for guess in item.demonstration:
    state, step = task.step(state, guess)
    observations.append(step.observation)
  assert step.done and step.reward == 1.0 and observations[-1] == "="
  assert all(o in "<>" for o in observations[:-1])
  # Binary search over 0-63 takes five or more turns for most secrets, at most seven.
  lengths = [len(i.demonstration) for i in task.sample(1, 200)]
  assert sum(n >= 5 for n in lengths) / len(lengths) > 0.6 and max(lengths) == 7
  # Wrong guesses: the episode ends unsuccessfully after max_turns.
  state = task.reset(item)
  for turn in range(task.max_turns):
    state, step = task.step(state, "junk" if turn % 2 else str((item.target + 1) % 64))
  assert step.done and step.reward == 0.0
  with pytest.raises(ValueError, match="ended"):
    task.step(state, "3")
  assert task.score(item, " ".join(item.demonstration)) == 1.0
  assert task.score(item, "1 2 3") < 1.0 or item.target in (1, 2, 3)
  shaped = get_task("search", shaping=True)
  assert shaped.score(item, " ".join(item.demonstration)) == pytest.approx(
    1 - 0.05 * (len(item.demonstration) - 1)
  )


def test_arith_held_out_problems_are_never_drawn_for_training():
  """With eval_share, "eval" draws only from a fixed share of the problems (by the prompt's
  CRC-32, recomputed here), "train" never from it; together they cover the whole space."""
  import zlib

  task = get_task("arith", terms=3, max_operand=3, ops="+", eval_share=0.25)
  train = {i.prompt for seed in range(40) for i in task.sample(seed, 32)}
  held = {i.prompt for seed in range(40) for i in task.sample(seed, 32, split="eval")}
  assert not train & held
  assert len(train | held) == 4**3  # every (a, b, c) in [0, 3]^3 was drawn by one split
  for prompt in train | held:
    in_eval = zlib.crc32(prompt.encode()) / 2**32 < 0.25
    assert (prompt in held) == in_eval
  assert 0.1 < len(held) / 4**3 < 0.4
  assert all(i.meta["terms"] == 3 for i in task.sample(0, 5, split="eval"))


def test_chain_is_four_term_sums_with_a_held_out_quarter():
  """The main job's task: every problem "a+b+c+d=" with operands in [0, 5], its demonstration
  the three running sums (recomputed here), and about a quarter of the 6**4 problems held out."""
  task = get_task("chain")
  for item in task.sample(11, 50) + task.sample(11, 50, split="eval"):
    values = [int(v) for v in item.prompt[:-1].split("+")]
    assert len(values) == 4 and all(0 <= v <= 5 for v in values)
    sums = np.cumsum(values)
    steps = [f"{a}+{v}={b}" for a, v, b in zip(sums[:-1], values[1:], sums[1:])]
    assert item.demonstration == ";".join(steps) + f";#{sums[-1]}" and item.target == sums[-1]
  held = {i.prompt for seed in range(30) for i in task.sample(seed, 64, split="eval")}
  assert not held & {i.prompt for seed in range(30) for i in task.sample(seed, 64)}
  assert 0.2 < len(held) / 6**4 < 0.3


def test_arith_without_eval_share_draws_both_splits_from_every_problem():
  task = get_task("arith")
  evaluated = [i.prompt for i in task.sample(7, 20, split="eval")]
  assert evaluated == [i.prompt for i in task.sample(7, 20)]


def test_an_empty_split_is_an_error_not_a_hang():
  task = get_task("arith", terms=2, max_operand=1, ops="+", eval_share=0.01)  # 4 problems
  held = [p for p in ("0+0=", "0+1=", "1+0=", "1+1=") if task.split_of(p) == "eval"]
  assert not held  # CRC-32 puts none of the four below 1% (checked here, not assumed)
  with pytest.raises(ValueError, match="split='eval' has no problems"):
    task.sample(0, 3, split="eval")


@pytest.mark.parametrize("name", ["arith", "coding", "search"])
def test_unknown_split_is_refused(name):
  with pytest.raises(ValueError, match="split='test'"):
    get_task(name).sample(0, 2, split="test")


@pytest.mark.parametrize(
  "name, options, match",
  [
    ("arith", {"terms": 1}, "terms=1"),
    ("arith", {"eval_share": 1.0}, "eval_share=1.0"),
    ("coding", {"level": 4}, "level=4"),
    ("search", {"bits": 6, "max_turns": 3}, "max_turns=3"),
  ],
)
def test_bad_task_options(name, options, match):
  with pytest.raises(ValueError, match=match):
    get_task(name, **options)


def test_unknown_task_lists_the_registered_ones():
  with pytest.raises(ValueError, match="arith.*coding.*search"):
    get_task("chess")
  assert {"arith", "coding", "search"} <= set(registered())


def test_a_flawed_teacher_writes_its_wrong_facts_one_too_high_and_carries_them_on():
  """`flawed_facts`/`flaw_rate`: each demonstration is a consistent chain (every step starts
  from the sum written before it); a step is written one too high only for a fact the
  teacher has wrong, and then at about `flaw_rate` of the times; the target (the reward)
  stays the true sum, which the teacher's wrong answers miss."""
  task = get_task("chain", flawed_facts=0.2, flaw_rate=0.7)
  counts = {"flawed": 0, "wrong": 0}
  for item in task.sample(5, 1500):
    values = [int(v) for v in item.prompt[:-1].split("+")]
    *steps, answer = item.demonstration.split(";")
    shown = values[0]
    for step, v in zip(steps, values[1:]):
      fact, written = step.split("=")
      assert fact == f"{shown}+{v}"
      assert int(written) in (shown + v, shown + v + 1)
      if task.is_flawed(fact):
        counts["flawed"] += 1
        counts["wrong"] += int(written) == shown + v + 1
      else:
        assert int(written) == shown + v
      shown = int(written)
    assert answer == f"#{shown}" and item.target == sum(values)
    assert task.score(item, item.demonstration) == float(shown == sum(values))
  rate = counts["wrong"] / counts["flawed"]
  assert counts["flawed"] > 300 and abs(rate - 0.7) < 4 * (0.7 * 0.3 / counts["flawed"]) ** 0.5


def test_flawed_facts_is_a_share_of_facts_and_the_listed_problems_stay_true():
  task = get_task("arith", terms=2, max_operand=60, ops="+", flawed_facts=0.25, flaw_rate=1.0)
  facts = [f"{a}+{b}" for a in range(61) for b in range(61)]
  share = np.mean([task.is_flawed(f) for f in facts])
  assert abs(share - 0.25) < 0.03
  chain = get_task("chain", flawed_facts=0.25)  # the same facts, whatever the task
  assert all(task.is_flawed(f) == chain.is_flawed(f) for f in facts)
  wrong = [i for i in task.sample(0, 300) if task.is_flawed(i.prompt[:-1])]
  assert wrong and all(task.score(i, i.demonstration) == 0.0 for i in wrong)  # rate 1: always
  listed = get_task("chain", flawed_facts=0.5, flaw_rate=1.0).problems("eval")
  assert all(get_task("chain").score(i, i.demonstration) == 1.0 for i in listed)


def test_without_flaws_the_sampler_draws_what_it_always_drew():
  """flawed_facts=0 (or flaw_rate=0) takes no extra draws: the same problems as before."""
  plain = [(i.prompt, i.demonstration) for i in get_task("chain").sample(9, 200)]
  assert plain == [
    (i.prompt, i.demonstration) for i in get_task("chain", flaw_rate=0.7).sample(9, 200)
  ]
  flawed = get_task("chain", flawed_facts=0.2, flaw_rate=0.0).sample(9, 200)
  assert [i.prompt for i in flawed] != [p for p, _ in plain]  # draws taken, none wrong
  assert all(get_task("chain").score(i, i.demonstration) == 1.0 for i in flawed)


@pytest.mark.parametrize(
  "name, value", [("flawed_facts", 1.5), ("flaw_rate", -0.1), ("flaw_rate", True)]
)
def test_flaw_options_out_of_range_are_named(name, value):
  with pytest.raises(ValueError, match=f"{name}={value!r} must be a number in \\[0, 1\\]"):
    get_task("chain", **{name: value})


def test_chain_flawed_is_chain_taught_by_a_flawed_teacher():
  """The main job's task: `chain`'s problems and held-out split, a fifth of its 96 step facts
  flawed at rate 0.6, so about a third or more of its demonstrations end on a wrong answer
  while every target stays the true sum."""
  assert (get_task("chain_flawed").flawed_facts, get_task("chain_flawed").flaw_rate) == (0.2, 0.6)
  task, chain = get_task("chain_flawed"), get_task("chain")
  assert [i.prompt for i in task.problems("eval")] == [i.prompt for i in chain.problems("eval")]
  facts = [f"{a}+{b}" for a in range(16) for b in range(6)]
  assert sum(map(task.is_flawed, facts)) == 23  # of 96 (SHA-256 of each fact: fixed)
  items = task.sample(4, 1000)
  assert all(i.target == sum(int(v) for v in i.prompt[:-1].split("+")) for i in items)
  wrong = np.mean([task.score(i, i.demonstration) == 0.0 for i in items])
  assert 0.3 < wrong < 0.6, wrong
  assert not any(map(chain.is_flawed, facts))  # chain itself: no flaws
  assert all(chain.score(i, i.demonstration) == 1.0 for i in chain.sample(4, 300))
