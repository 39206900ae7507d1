"""A crashed xdist worker fails the test it was running; the rest of its file still runs.

pytest-xdist (3.8) replaces a worker that dies (a segfault, or pytest-timeout's thread
method ending a test that ran past `timeout`) and reports the test it was running as
failed. Under `--dist loadfile` (this suite's default, `pyproject.toml`) and `loadscope`,
(and `loadgroup`), though, it puts the dead worker's whole file back in the queue with that test still
pending: the next worker runs it again, crashes again, and after `--max-worker-restart`
crashes (4 per worker) the whole session stops with "maximum crashed workers reached",
the rest of the suite unrun. The scheduler here marks the crashed test done before the
file goes back in the queue, so the replacement worker carries on after it.

A second crash while the first one's replacement is still collecting made xdist hand work
to that replacement before it had a collection (an INTERNALERROR, KeyError on the worker in
`_assign_work_unit`); such a worker is now given work once its collection arrives.
"""

import pytest


def _running(workload: dict) -> str | None:
  """The test a worker was running: the first one of its work it has not reported."""
  for unit in workload.values():
    for nodeid, completed in unit.items():
      if not completed:
        return nodeid
  return None


def _crash_once(base: type) -> type:
  """`base` (a scope scheduler of xdist) whose `remove_node` retires the crashed test."""

  class CrashedTestFailsOnce(base):
    def remove_node(self, node):
      crashed = _running(self.assigned_work.get(node, {}))
      if crashed is None:  # a worker that finished its work, at shutdown
        return super().remove_node(node)
      for unit in self.assigned_work[node].values():
        if crashed in unit:
          unit[crashed] = True
      super().remove_node(node)  # re-queues the file's tests after the crashed one
      return crashed

    def _reschedule(self, node):
      if node not in self.registered_collections:  # a replacement worker still collecting
        return
      super()._reschedule(node)

  return CrashedTestFailsOnce


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`loadfile`, `loadscope` and `loadgroup` with the crashed test retired; the other modes
  as xdist has them (`load` and `worksteal` already drop the crashed test)."""
  from xdist import scheduler  # noqa: PLC0415

  base = {
    "loadfile": scheduler.LoadFileScheduling,
    "loadscope": scheduler.LoadScopeScheduling,
    "loadgroup": scheduler.LoadGroupScheduling,
  }.get(config.getvalue("dist"))
  return None if base is None else _crash_once(base)(config, log)
