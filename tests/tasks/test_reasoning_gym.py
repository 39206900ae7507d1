"""The rg:<name> adapter (needs the rg extra, which the dev extra includes)."""

import pytest

from trace_jax.tasks import get_task

pytest.importorskip("reasoning_gym", reason="the rg extra (reasoning-gym) is not installed")


def test_solver_scores_one_and_wrong_less():
  task = get_task("rg:basic_arithmetic")
  for item in task.sample(0, 10):
    assert task.score(item, item.demonstration) == 1.0
    assert task.score(item, "#" + str(item.target["answer"]) + "0") == 0.0


def test_partial_credit_is_dropped_unless_asked():
  task = get_task("rg:basic_arithmetic")
  item = task.sample(1, 1)[0]
  padded = (
    f"#{item.target['answer']} 123"  # contains the oracle: reasoning-gym gives partial credit
  )
  assert task.score(item, padded) == 0.0
  lenient = get_task("rg:basic_arithmetic", partial_credit=True)
  assert 0.0 < lenient.score(item, padded) < 1.0


@pytest.mark.parametrize("name", ["n_queens", "puzzle24", "simple_integration", "codeio"])
def test_tasks_that_evaluate_model_text_are_refused(name):
  with pytest.raises(ValueError, match="refused"):
    get_task(f"rg:{name}")


def test_unknown_dataset():
  with pytest.raises(ValueError, match="not a reasoning-gym dataset"):
    get_task("rg:no_such_task")
