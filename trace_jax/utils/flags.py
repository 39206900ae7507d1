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
"""

from __future__ import annotations

import dataclasses
import math
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
) -> Any:
  """A config field with its one line of help. `flat`: its flat name if not the field's;
  `flag`: its flag's name if not the flat name (False: no flag); `choices`: an enum flag;
  `parse(flag name, strings)`: a list flag's value."""
  meta = dict(help=help, flat=flat, flag=flag, choices=tuple(choices) if choices else None)
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
