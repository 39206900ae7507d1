"""Tasks: solvers score 1.0, wrong answers less, determinism, the multi-turn environment."""

import pytest

from trace_jax.tasks import get_task, registered

SINGLE_TURN = [("arith", {}), ("arith", {"terms": 4, "max_operand": 50, "ops": "+-*"}),
               ("coding", {"level": 1}), ("coding", {"level": 2}), ("coding", {"level": 3})]


@pytest.mark.parametrize("name, options", SINGLE_TURN)
def test_solver_scores_one_and_wrong_answers_less(name, options):
  task = get_task(name, **options)
  items = task.sample(3, 40)
  for item in items:
    assert task.score(item, item.demonstration) == 1.0
    assert task.score(item, "") == 0.0
  wrong = {"arith": lambda i: f"#{i.target + 1}", "coding": lambda i: i.demonstration + "+1"}[name]
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
  program = "x==" + str(right_on[0][0]) + "?" + str(right_on[0][1]) + ":(x==" + str(right_on[1][0]) \
            + "?" + str(right_on[1][1]) + ":-1)"
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
      1 - 0.05 * (len(item.demonstration) - 1))


@pytest.mark.parametrize("name, options, match", [
    ("arith", {"terms": 1}, "terms=1"),
    ("coding", {"level": 4}, "level=4"),
    ("search", {"bits": 6, "max_turns": 3}, "max_turns=3"),
])
def test_bad_task_options(name, options, match):
  with pytest.raises(ValueError, match=match):
    get_task(name, **options)


def test_unknown_task_lists_the_registered_ones():
  with pytest.raises(ValueError, match="arith.*coding.*search"):
    get_task("chess")
  assert {"arith", "coding", "search"} <= set(registered())
