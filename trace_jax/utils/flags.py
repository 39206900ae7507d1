"""Config dataclasses as flat namespaces: the one source of the scripts' flags (defaults and
help) and of the names saved configs are compared by.

A config is a tree of frozen dataclasses: a field whose default is a dataclass instance is a
section (`RLConfig.sampling`), every other field a leaf. Each leaf has a flat name, unique
in its tree: its own name, or the `flat` name given to `knob` (QuantConfig.sites is
`fp4_sites`), a flag (by that name unless `knob(flag=...)` says otherwise) and one line of
help. So:

  flat_fields(RLConfig)          {flat name: (path, dataclasses.Field)}
  to_flat(config) / from_flat    a config <-> {flat name: value}
  flatten(RLConfig, saved_dict)  a saved (JSON) config, nested or flat, by flat name
  define_flags(RLConfig)         one absl flag per leaf: its default, its help, its type
  from_flags(RLConfig, holders)  the config back from the parsed flags
  grouped_help(RLConfig, ...)    those flags' help, by section, with defaults and allowed values

A leaf's help section is its knob's `section`, else the section (top-level field) that holds
it, else "run": the sections of the help are the config's own, so they cannot drift from it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import textwrap
from typing import Any, Callable, Iterable

from absl import flags as absl_flags


def knob(
  default: Any,
  help: str,
  *,
  flat: str | None = None,
  flag: str | bool | None = None,
  choices: Iterable[str] | None = None,
  parse: Callable[[str, list[str]], Any] | None = None,
  section: str | None = None,
) -> Any:
  """A config field with its one line of help. `flat`: its flat name if not the field's;
  `flag`: its flag's name if not the flat name (False: no flag); `choices`: an enum flag;
  `parse(flag name, strings)`: a list flag's value; `section`: its section in the help
  (`grouped_help`) if not the one that holds it."""
  choices = tuple(choices) if choices else None
  meta = dict(help=help, flat=flat, flag=flag, choices=choices, section=section)
  return dataclasses.field(default=default, metadata={**meta, "parse": parse})


def check_choices(config, where: str) -> None:
  """A ValueError naming the first field of `config` whose value is not one of its knob's
  `choices` (the flag's enum is the same list)."""
  for field in dataclasses.fields(config):
    allowed = field.metadata.get("choices")
    if allowed and getattr(config, field.name) not in allowed:
      value = getattr(config, field.name)
      raise ValueError(f"{where}.{field.name}={value!r} is not allowed; use one of {allowed}")


def _is_section(field: dataclasses.Field) -> bool:
  return dataclasses.is_dataclass(field.default) and not isinstance(field.default, type)


def flat_name(field: dataclasses.Field) -> str:
  return field.metadata.get("flat") or field.name


def flat_fields(cls) -> dict[str, tuple[tuple[str, ...], dataclasses.Field]]:
  """{flat name: (path of field names, leaf Field)} of a config class, depth first."""
  out = {}
  for field in dataclasses.fields(cls):
    if _is_section(field):
      for name, (path, leaf) in flat_fields(type(field.default)).items():
        out[name] = ((field.name,) + path, leaf)
    else:
      out[flat_name(field)] = ((field.name,), field)
  return out


def to_flat(config) -> dict[str, Any]:
  """{flat name: value} of a config instance."""
  out = {}
  for name, (path, _) in flat_fields(type(config)).items():
    value = config
    for part in path:
      value = getattr(value, part)
    out[name] = value
  return out


def from_flat(cls, values: dict[str, Any], base=None):
  """An instance of `cls` (or `base` with changes) from {flat name: value}; a ValueError
  naming unknown names."""
  leaves = flat_fields(cls)
  unknown = sorted(set(values) - set(leaves))
  if unknown:
    raise ValueError(f"{cls.__name__} has no fields {unknown}; fields: {sorted(leaves)}")
  by_path = {leaves[name][0]: value for name, value in values.items()}
  return _build(cls, base, by_path, ())


def _build(cls, base, by_path: dict, prefix: tuple):
  changes = {}
  for field in dataclasses.fields(cls):
    path = prefix + (field.name,)
    if _is_section(field):
      if any(p[: len(path)] == path for p in by_path):
        current = field.default if base is None else getattr(base, field.name)
        changes[field.name] = _build(type(field.default), current, by_path, path)
    elif path in by_path:
      changes[field.name] = by_path[path]
  return cls(**changes) if base is None else dataclasses.replace(base, **changes)


def flatten(cls, saved: dict) -> dict[str, Any]:
  """A saved config dict by flat name: sections (any depth, as `cls` nests them) are opened
  and their leaves named as `cls` names them; keys `cls` does not know are kept as they are
  (a config saved flat, before its sections existed, flattens to the same names)."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  out = {}
  for key, value in saved.items():
    field = fields.get(key)
    if field is not None and _is_section(field) and isinstance(value, dict):
      out.update(flatten(type(field.default), value))
    else:
      out[key if field is None else flat_name(field)] = value
  return out


def parse_pairs(name: str, strings: list[str], *, bools: bool = False) -> tuple:
  """key=value strings -> ((key, value), ...), ints and floats (and with `bools`, true /
  false) parsed."""
  out = []
  for kv in strings:
    if "=" not in kv:
      raise ValueError(
        f"--{name} expects key=value, got {kv!r} (the flag is a comma-separated list: a "
        "value cannot hold a comma; dataset columns= pairs are separated by ';')"
      )
    key, text = kv.split("=", 1)
    out.append((key, _parse_value(text, bools)))
  return tuple(out)


def parse_bool_pairs(name: str, strings: list[str]) -> tuple:
  return parse_pairs(name, strings, bools=True)


def _parse_value(text: str, bools: bool):
  if text.lstrip("-").isdigit():
    return int(text)
  try:
    number = float(text)
  except ValueError:
    return {"true": True, "false": False}.get(text.lower(), text) if bools else text
  return number if math.isfinite(number) else text


def parse_ints(name: str, strings: list[str]) -> tuple:
  try:
    return tuple(int(s) for s in strings)
  except ValueError as e:
    raise ValueError(f"--{name} expects integers, got {strings}") from e


def parse_floats(name: str, strings: list[str]) -> tuple:
  try:
    return tuple(float(s) for s in strings)
  except ValueError as e:
    raise ValueError(f"--{name} expects numbers, got {strings}") from e


def _list_default(value: tuple) -> list[str]:
  return [f"{item[0]}={item[1]}" if isinstance(item, tuple) else str(item) for item in value]


def define_flags(
  cls,
  *,
  only: Iterable[str] | None = None,
  choices: dict[str, Iterable[str]] | None = None,
  flag_values=absl_flags.FLAGS,
) -> dict:
  """One absl flag per leaf of `cls` (or per flat name in `only`), with the field's default
  and help: {flat name: FlagHolder}. Enums for the field's `choices` (or those given here by
  flat name), lists for tuples."""
  holders = {}
  for name, (_, field) in flat_fields(cls).items():
    flag = field.metadata.get("flag")
    if flag is False or (only is not None and name not in only):
      continue
    default, text = field.default, field.metadata.get("help", "")
    kwargs = dict(name=flag or name, help=text, flag_values=flag_values)
    enum = (choices or {}).get(name) or field.metadata.get("choices")
    if enum:
      holders[name] = absl_flags.DEFINE_enum(default=default, enum_values=list(enum), **kwargs)
    elif isinstance(default, bool) or (default is None and str(field.type).startswith("bool")):
      holders[name] = absl_flags.DEFINE_bool(default=default, **kwargs)
    elif isinstance(default, int):
      holders[name] = absl_flags.DEFINE_integer(default=default, **kwargs)
    elif isinstance(default, float):
      holders[name] = absl_flags.DEFINE_float(default=default, **kwargs)
    elif isinstance(default, tuple):
      holders[name] = absl_flags.DEFINE_list(default=_list_default(default), **kwargs)
    else:
      holders[name] = absl_flags.DEFINE_string(default=default, **kwargs)
  return holders


def from_flags(cls, holders: dict, base=None):
  """The config of the parsed flags `holders` (from `define_flags`); list flags through
  their field's `parse`. A ValueError names a bad field or value."""
  leaves = flat_fields(cls)
  values = {}
  for name, holder in holders.items():
    value, parse = holder.value, leaves[name][1].metadata.get("parse")
    if isinstance(value, list):
      value = parse(holder.name, value) if parse else tuple(value)
    values[name] = value
  return from_flat(cls, values, base)


def help_section(path: tuple[str, ...], field: dataclasses.Field) -> str:
  """The help section of the leaf at `path`: its knob's `section`, else the top-level
  section holding it, else "run"."""
  return field.metadata.get("section") or (path[0] if len(path) > 1 else "run")


def grouped_help(
  cls,
  holders: dict,
  *,
  extra: dict[str, list] | None = None,
  flag_values=absl_flags.FLAGS,
  width: int = 96,
) -> str:
  """The help of `cls`'s flags (`holders`, from `define_flags`), grouped by section
  (`help_section`): each flag with its help, its default and what it accepts. The groups of
  top-level leaves come first, in field order, then `cls`'s sections in field order, each
  headed by the first sentence of its class docstring. `extra`: a script's own flags
  ({section: [FlagHolder, ...]}), last in their section; a section `cls` lacks comes first."""
  nested = {f.name: f for f in dataclasses.fields(cls) if _is_section(f)}
  leaves = [
    (help_section(path, field), len(path) > 1, holders[name].name)
    for name, (path, field) in flat_fields(cls).items()
    if name in holders
  ]
  groups: dict[str, list[str]] = {}
  for section in extra or {}:
    if section not in nested and all(section != group for group, _, _ in leaves):
      groups[section] = []
  for section, _, _ in leaves:
    if section not in nested:
      groups.setdefault(section, [])
  groups.update({section: [] for section in nested})
  for inner in (False, True):  # a section's top-level leaves before its own
    for section, is_inner, name in leaves:
      if is_inner == inner:
        groups[section].append(name)
  for section, more in (extra or {}).items():
    groups[section] += [holder.name for holder in more]
  out = []
  for section, names in groups.items():
    if not names:
      continue
    heading = f"{section}:"
    if section in nested:
      heading += " " + _first_sentence(type(nested[section].default))
    out.extend(_wrap(heading, width, "", "  "))
    out.extend(_flag_help(flag_values[name], width) for name in names)
    out.append("")
  return "\n".join(out).rstrip() + "\n"


def _first_sentence(cls) -> str:
  text = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
  end = text.find(". ")
  return text if end < 0 else text[: end + 1]


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
  # never inside a word: flag names and values (trace-sparse, dataset:PATH) stay whole
  return textwrap.wrap(
    text,
    width,
    initial_indent=first,
    subsequent_indent=rest,
    break_on_hyphens=False,
    break_long_words=False,
  )


def _flag_help(flag, width: int) -> str:
  """`--name: help` and `(default: ...; what it accepts)`, wrapped under it."""
  text, accepts = flag.help or "", getattr(flag.parser, "syntactic_help", "")
  enum_values = getattr(flag.parser, "enum_values", None)
  if enum_values:
    prefix = f"<{'|'.join(enum_values)}>: "
    text = text[len(prefix) :] if text.startswith(prefix) else text
    accepts = "one of: " + ", ".join(enum_values)
  elif isinstance(flag, absl_flags.BooleanFlag):
    accepts = f"true or false (--{flag.name} / --no{flag.name})"
  facts = [] if flag.default is None else [f"default: {_shown(flag.default)}"]
  facts += [accepts] if accepts else []
  lines = _wrap(f"--{flag.name}: {text}", width, "  ", "      ")
  if facts:
    lines += _wrap(f"({'; '.join(facts)})", width, "      ", "      ")
  return "\n".join(lines)


def _shown(default) -> str:
  if isinstance(default, bool):
    return str(default).lower()
  if isinstance(default, list):
    return ",".join(map(str, default)) if default else "(empty)"
  return '""' if default == "" else str(default)
