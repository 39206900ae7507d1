"""A Jinja sandbox with limits on time and size, for chat templates read from a checkpoint.

jinja2's `ImmutableSandboxedEnvironment` blocks attribute escapes, but not work: nested
`range(100000)` loops, `9 ** 9 ** 9` or `'x' * 10 ** 12` each keep a process busy for
minutes (or exhaust its memory) inside one render. A template is code from the checkpoint's
author, so every render here runs under

  1. a wall-clock deadline, checked at every loop iteration, call, filter, attribute or item
     access, operator, `~` concatenation and output chunk (Jinja has no `while`: a template
     that runs long does so in loops or recursion, and both pass through these checks);
  2. size limits checked before the operation that would allocate: `range` at most
     jinja2.sandbox.MAX_RANGE items (jinja2's own bound), `**` and `*` on integers at most
     MAX_INT_BITS bits, `*` and `+` on strings and lists, `~`, `join` and `replace` at most
     `max_chars` items, and no width, precision or integer argument (`center(10 ** 12)`,
     `'%0999999999d'`) past `max_chars`;
  3. the output, produced chunk by chunk (`Template.generate`), at most `max_chars`
     characters.

What a template does within these limits renders exactly as jinja2 renders it: the checks
only refuse. A refusal raises `TemplateLimitError`; every other failure of the template
(ZeroDivisionError, RecursionError, MemoryError, ...) propagates to the caller
(`tasks.chat.ChatTemplate`), which turns each into one error naming the template's file.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Iterable

from jinja2 import nodes, pass_context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

MAX_INT_BITS = 1 << 16  # an integer result of `**` or `*` past this many bits is refused

_LOOP_FILTER = "trace_jax_checked_loop"
_TEXT_FILTER = "trace_jax_checked_text"
# %-format and str.format widths and precisions: `%08.3f`, `{:>20}`, `{0:.5}`
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\d*)(?:\.(\d*))?")
_FORMAT_SPEC = re.compile(r"\{[^{}]*?:[^{}]*?\}")


class TemplateLimitError(Exception):
  """A render that ran past its deadline or would make something past a size limit."""


class _Wrap(NodeTransformer):
  """Routes every for-loop's iterable and every `~` concatenation through a checked filter."""

  def visit_For(self, node: nodes.For) -> nodes.For:
    self.generic_visit(node)
    node.iter = nodes.Filter(node.iter, _LOOP_FILTER, [], [], None, None, lineno=node.lineno)
    return node

  def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
    self.generic_visit(node)
    return nodes.Filter(node, _TEXT_FILTER, [], [], None, None, lineno=node.lineno)


def _sized(value: Any) -> int:
  return len(value) if isinstance(value, (str, list, tuple, dict)) else 0


def _ints(values: Iterable[Any]) -> Iterable[int]:
  """The integers among `values`, one level into tuples, lists and dicts (format arguments)."""
  for value in values:
    if isinstance(value, dict):
      value = list(value.values())
    if isinstance(value, (tuple, list)):
      yield from (v for v in value if isinstance(v, int))
    elif isinstance(value, int):
      yield value


class LimitedSandbox(ImmutableSandboxedEnvironment):
  """An immutable sandbox whose renders obey a deadline and size limits (module docstring).

  Args:
    time_limit_s: the wall-clock seconds one render may take.
    max_chars: the most characters (or items) a render may output or build.
    **kwargs: the jinja2 Environment's options.
  """

  # every operator: none is folded at compile time (jinja2 does not fold intercepted ones),
  # so `9 ** 9 ** 9` cannot hang the compiler either
  intercepted_binops = frozenset(ImmutableSandboxedEnvironment.default_binop_table)

  def __init__(self, *, time_limit_s: float, max_chars: int, **kwargs: Any):
    super().__init__(**kwargs)
    self.time_limit_s, self.max_chars = float(time_limit_s), int(max_chars)
    self._state = threading.local()  # the deadline of the render in progress, per thread
    self.filters[_LOOP_FILTER] = pass_context(lambda context, iterable: self._loop(iterable))
    self.filters[_TEXT_FILTER] = pass_context(lambda context, text: self._text(text))
    for name in (_LOOP_FILTER, _TEXT_FILTER):
      self.filters[name].checked = True

  # --- the limits ---------------------------------------------------------------------------

  def check_time(self) -> None:
    deadline = getattr(self._state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
      raise TemplateLimitError(f"the render ran past its time limit of {self.time_limit_s:g} s")

  def _check_size(self, size: int, what: str) -> None:
    if size > self.max_chars:
      raise TemplateLimitError(
        f"{what} would hold {size} items, past the limit of {self.max_chars}"
      )

  def _check_int(self, value: int, what: str) -> None:
    self._check_size(abs(value), f"{what} (an integer argument)")

  def _check_widths(self, text: str) -> None:
    """Refuse %-format or str.format widths and precisions past max_chars."""
    numbers = [n for m in _PERCENT_SPEC.finditer(text) for n in m.groups() if n]
    numbers += [n for m in _FORMAT_SPEC.finditer(text) for n in re.findall(r"\d+", m.group())]
    for number in numbers:
      self._check_size(int(number), "a format width")

  def _checked_result(self, value: Any, what: str) -> Any:
    self._check_size(_sized(value), what)
    return value

  # --- rendering ----------------------------------------------------------------------------

  def render_checked(self, template, variables: dict) -> str:
    """`template` (from `compile_checked`) rendered with `variables`, under the limits."""
    self._state.deadline = time.monotonic() + self.time_limit_s
    try:
      chunks, size = [], 0
      for chunk in template.generate(**variables):
        size += len(chunk)
        self._check_size(size, "the output")
        self.check_time()
        chunks.append(chunk)
      return "".join(chunks)
    finally:
      self._state.deadline = None

  def compile_checked(self, source: str):
    """The template of `source`, its loops and `~` concatenations routed through the checks,
    its filters (those registered by now) checked."""
    self.filters = {
      name: f if getattr(f, "checked", False) else self._checked_filter(f)
      for name, f in self.filters.items()
    }
    return self.from_string(_Wrap().visit(self.parse(source)))

  def _loop(self, iterable: Any):
    self.check_time()
    for item in iterable:
      self.check_time()
      yield item

  def _text(self, text: Any) -> Any:
    self.check_time()
    return self._checked_result(text, "a `~` concatenation")

  def _checked_filter(self, f):
    """`f` with the deadline, its integer arguments and its result checked (and `join`'s,
    `replace`'s and `format`'s sizes before they are built)."""
    name = getattr(f, "__name__", "")
    passed = 1 if hasattr(f, "jinja_pass_arg") else 0  # a context or environment comes first

    def checked(*args, **kwargs):
      self.check_time()
      values = list(args[passed:])  # the value filtered, then the filter's arguments
      for value in _ints(values[1:] + list(kwargs.values())):
        self._check_int(value, f"filter {name}")
      if values:
        if name == "do_join":
          self._check_join(values[0], values[1] if len(values) > 1 else kwargs.get("d", ""))
        elif name == "do_replace" and len(values) >= 3:
          self._check_replace(str(values[0]), str(values[1]), str(values[2]))
        elif name == "do_format" and isinstance(values[0], str):
          self._check_widths(values[0])
      return self._checked_result(f(*args, **kwargs), f"filter {name}'s result")

    checked.__name__, checked.checked = name, True
    if passed:
      checked.jinja_pass_arg = f.jinja_pass_arg
    return checked

  def _check_join(self, items: Any, separator: Any) -> None:
    if isinstance(items, (list, tuple)):
      strings = [len(i) for i in items if isinstance(i, str)]
      self._check_size(sum(strings) + len(str(separator)) * len(items), "a join")

  def _check_replace(self, text: str, old: str, new: str) -> None:
    count = text.count(old)
    self._check_size(len(text) + count * max(0, len(new) - len(old)), "a replace")

  # --- jinja2's sandbox hooks ---------------------------------------------------------------

  def call_binop(self, context, operator_name: str, left: Any, right: Any) -> Any:
    self.check_time()
    ints = isinstance(left, int) and isinstance(right, int)
    if operator_name == "**" and ints and right > 0:
      bits = max(left.bit_length(), 1) * right
      if bits > MAX_INT_BITS:
        raise TemplateLimitError(
          f"{left} ** {right} would have about {bits} bits, past the limit of {MAX_INT_BITS}"
        )
    elif operator_name == "*":
      if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"a product past {MAX_INT_BITS} bits")
      for sequence, count in ((left, right), (right, left)):
        if _sized(sequence) and isinstance(count, int):
          self._check_size(len(sequence) * count, "a `*` repetition")
    elif operator_name == "+":
      self._check_size(_sized(left) + _sized(right), "a `+` concatenation")
    elif operator_name == "%" and isinstance(left, str):
      self._check_widths(left)
      for value in _ints(right if isinstance(right, (tuple, dict)) else [right]):
        self._check_int(value, "a %-format")
    return self._checked_result(
      self.binop_table[operator_name](left, right), f"the `{operator_name}` result"
    )

  def getattr(self, obj: Any, attribute: str) -> Any:
    self.check_time()
    return super().getattr(obj, attribute)

  def getitem(self, obj: Any, argument: Any) -> Any:
    self.check_time()
    return super().getitem(obj, argument)

  def wrap_str_format(self, value: Any):
    wrapper = super().wrap_str_format(value)
    if wrapper is None:
      return None
    self._check_widths(value.__self__)

    def checked(*args, **kwargs):
      for number in _ints(list(args) + list(kwargs.values())):
        self._check_int(number, "a str.format")
      return self._checked_result(wrapper(*args, **kwargs), "a str.format result")

    return checked

  def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
    __self.check_time()
    for value in _ints(list(args) + list(kwargs.values())):
      __self._check_int(value, f"a call of {getattr(__obj, '__name__', 'a callable')}")
    if getattr(__obj, "__name__", "") == "replace" and isinstance(
      getattr(__obj, "__self__", None), str
    ):
      old, new = (list(args) + [kwargs.get("old", ""), kwargs.get("new", "")])[:2]
      __self._check_replace(__obj.__self__, str(old), str(new))
    if (
      getattr(__obj, "__name__", "") == "join"
      and isinstance(getattr(__obj, "__self__", None), str)
      and args
    ):
      __self._check_join(args[0], __obj.__self__)
    result = super().call(__context, __obj, *args, **kwargs)
    return __self._checked_result(result, "a call's result")
