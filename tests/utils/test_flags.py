"""utils.flags.grouped_help: a config's flags by section, with defaults and allowed values."""

import dataclasses

from absl import flags

from trace_jax.utils import flags as config_flags
from trace_jax.utils.flags import knob


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
  """What the inner part holds. More text that the heading leaves out."""

  size: int = knob(4, "How many.")
  mode: str = knob("fast", "How.", choices=("fast", "slow"))
  moved: bool = knob(False, "Listed under the outer group.", section="outer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
  name: str = knob("", "A name.")
  scale: tuple = knob((1, 2), "Two counts.", section="outer")
  inner: Inner = Inner()


def test_flags_are_grouped_by_section_with_defaults_and_allowed_values():
  values = flags.FlagValues()
  holders = config_flags.define_flags(Outer, flag_values=values)
  extra = {
    "script": [flags.DEFINE_string("out", None, "Where.", flag_values=values)],
    "outer": [flags.DEFINE_integer("hosts", None, "Hosts.", flag_values=values)],
  }
  text = config_flags.grouped_help(Outer, holders, extra=extra, flag_values=values)
  headings = [line for line in text.splitlines() if line and not line.startswith(" ")]
  # a script's own section first; then the top-level leaves' groups; then the sections,
  # each headed by its docstring's first sentence
  assert headings == ["script:", "run:", "outer:", "inner: What the inner part holds."]
  sections = dict(zip(headings, text.split("\n\n")))
  assert sections["outer:"].split("\n")[1:] == [
    "  --scale: Two counts.",
    "      (default: 1,2; a comma separated list)",
    "  --moved: Listed under the outer group.",
    "      (default: false; true or false (--moved / --nomoved))",
    "  --hosts: Hosts.",
    "      (an integer)",
  ]
  assert '--name: A name.\n      (default: "")' in sections["run:"]
  inner = sections["inner: What the inner part holds."]
  assert "--size: How many.\n      (default: 4; an integer)" in inner
  assert "--mode: How.\n      (default: fast; one of: fast, slow)" in inner
  assert "moved" not in inner
