"""A wall-clock limit on a Python call, on the main thread or any other.

`call(seconds, fn, *args)` is `fn(*args)`, or `TimeLimitExceeded` once it has run `seconds`.
The exception is raised inside `fn`, and again every `REPEAT_S` until `fn` is left (code that
swallows the first, e.g. a bare `except:` deep in a library, meets the next). It derives
from BaseException, so the `except Exception` clauses of the code it interrupts (sympy's and
math-verify's are everywhere) do not stop it.

How it gets in:

  main thread   SIGALRM (`signal.setitimer`): CPython checks for signals inside long
                integer arithmetic too, so it interrupts `9 ** 387420489` in C. The handler
                raises only while `fn` is on the stack, so an alarm on its way as `fn`
                returns does nothing.
  other threads a watchdog thread calls `PyThreadState_SetAsyncExc`, which lands between
                two bytecodes: it interrupts Python code but not one long C call (a huge
                integer power runs to its end). A caller off the main thread keeps such
                calls out of `fn` itself (`tasks.answers` does).

A `call` inside another's `fn` on the same thread runs under the outer limit only.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time

REPEAT_S = 0.25  # how often the exception is raised again until fn is left


class TimeLimitExceeded(BaseException):
  """A `call` ran past its limit."""


_local = threading.local()  # .inside: this thread is in a limited call
_watch = threading.Condition()
_deadlines: dict[int, float] = {}  # thread ident -> monotonic deadline, under _watch
_watchdog: list[threading.Thread] = []


def _limited(fn, args, kwargs):
  """The frame whose presence on the stack means "inside the limit"."""
  return fn(*args, **kwargs)


def _inside(frame) -> bool:
  while frame is not None:
    if frame.f_code is _limited.__code__:
      return True
    frame = frame.f_back
  return False


def _on_alarm(signum, frame) -> None:
  del signum
  if _inside(frame):
    raise TimeLimitExceeded


def _raise_in(ident: int, exc) -> None:
  """Sets (exc) or clears (None) the exception pending for thread `ident`."""
  ctypes.pythonapi.PyThreadState_SetAsyncExc(
    ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None
  )


def _watch_deadlines() -> None:
  with _watch:
    while True:
      if not _deadlines:
        _watch.wait()
        continue
      now = time.monotonic()
      frames = None
      for ident, deadline in _deadlines.items():
        if deadline <= now:
          frames = sys._current_frames() if frames is None else frames
          if _inside(frames.get(ident)):
            _raise_in(ident, TimeLimitExceeded)
      _watch.wait(max(min(_deadlines.values()) - now, REPEAT_S))


def _arm_thread(ident: int, seconds: float) -> None:
  with _watch:
    if not _watchdog:
      _watchdog.append(threading.Thread(target=_watch_deadlines, name="time_limit", daemon=True))
      _watchdog[0].start()
    _deadlines[ident] = time.monotonic() + seconds
    _watch.notify()


def _disarm_thread(ident: int) -> None:
  with _watch:
    _deadlines.pop(ident, None)
    _raise_in(ident, None)  # one set as fn returned, not yet raised


def call(seconds: float, fn, *args, **kwargs):
  """`fn(*args, **kwargs)` under a wall-clock limit of `seconds` (module docstring).

  Raises:
    TimeLimitExceeded: fn ran past the limit.
  """
  if getattr(_local, "inside", False):  # an outer call's limit applies
    return fn(*args, **kwargs)
  seconds = max(float(seconds), 1e-6)
  main = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
  ident = threading.get_ident()
  _local.inside = True
  try:
    if main:
      previous = signal.signal(signal.SIGALRM, _on_alarm)
      try:
        signal.setitimer(signal.ITIMER_REAL, seconds, REPEAT_S)
        return _limited(fn, args, kwargs)
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    _arm_thread(ident, seconds)
    try:
      return _limited(fn, args, kwargs)
    finally:
      # the watchdog sets the exception only while fn is on the stack, but it can land
      # just after fn returns (here, once); a second comes REPEAT_S later at the earliest
      try:
        _disarm_thread(ident)
      except TimeLimitExceeded:
        _disarm_thread(ident)
  finally:
    _local.inside = False
