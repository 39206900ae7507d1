"""Hugging Face architectures: one two-way name table and config mapping each.

An `Arch` says, for one Hugging Face model family, how its checkpoints name our
parameters (`NameTable`) and how its config.json maps onto `ModelConfig`, in both
directions: `model.hf` reads checkpoints with it, `export` writes them with it. Each family
is one module of this package (`archs/<ModelConfig.arch>.py`, defining `ARCH`), found by
its name in `config.ARCHS`.

A name table row pairs one of our parameters (its NNX path, "{layer}" for the block index)
with the Hugging Face tensor it is, and says how the arrays differ (`Name.kind`). Export
writes the first spelling; import reads the first spelling the checkpoint holds (the same
tensor as another transformers version names it) and, for routed experts, also their fused
3-D layout. Rows of parameters a model does not have (a dense MLP in an all-MoE model) are
simply never used.

Adding a family built from existing blocks touches two places: its module here (`NAMES`,
mostly `decoder.DECODER` plus its feed-forward rows; `config_from_hf` and `hf_config`, mostly
`decoder.moe_config_from_hf` / `moe_hf_config` with its own field names) and its name in
`config.ARCHS` (plus a preset in `config.py` if wanted). Import, export, the FP4 export's
`ignore` list and its packed tensors all follow from the table.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Iterator

import numpy as np

from trace_jax.model.config import ARCHS, ModelConfig

KINDS = ("plain", "linear", "conv1d")


@dataclasses.dataclass(frozen=True)
class Name:
  """One row of a name table.

  Attributes:
    ours: our parameter's NNX path, dotted; "{layer}" stands for the block index.
    theirs: the Hugging Face tensor name(s), with "{layer}" (and "{expert}" for routed
      experts): the first is written on export; import reads the first one present.
    kind: "plain" (the same array), "linear" (theirs [out, in], ours [in, out]) or "conv1d"
      (a depthwise kernel: theirs [C, 1, K], ours [K, C]).
    experts: ours stacks routed experts [E, in, out]; theirs is one tensor per expert.
    fused: for experts, the 3-D tensor holding every expert [E, parts * out, in] in
      transformers' fused layout, as (name, part, parts) (read only).
  """

  ours: str
  theirs: tuple[str, ...]
  kind: str = "linear"
  experts: bool = False
  fused: tuple[str, int, int] | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Name({self.ours!r}).kind={self.kind!r} is not one of {KINDS}")
    if not self.theirs:
      raise ValueError(f"Name({self.ours!r}) names no Hugging Face tensor")
    if self.experts != all("{expert}" in t for t in self.theirs) or (
      self.fused is not None and not self.experts
    ):
      raise ValueError(
        f"Name({self.ours!r}): routed experts (and only they) spell '{{expert}}' and may "
        f"have a fused layout; theirs={self.theirs}"
      )


def plain(ours: str, *theirs: str) -> Name:
  return Name(ours, theirs, "plain")


def linear(ours: str, *theirs: str) -> Name:
  return Name(ours, theirs, "linear")


def conv1d(ours: str, *theirs: str) -> Name:
  return Name(ours, theirs, "conv1d")


def experts(ours: str, *theirs: str, fused: tuple[str, int, int] | None = None) -> Name:
  return Name(ours, theirs, "linear", experts=True, fused=fused)


def _transpose(a):
  return np.swapaxes(a, -1, -2)


class Checkpoint:
  """A checkpoint's tensors by name, remembering which were read (to report the rest) and
  in what order (to name the tensors behind a parameter)."""

  def __init__(self, tensors: dict):
    self.tensors = tensors
    self.used: set[str] = set()
    self.reads: list[str] = []

  def __contains__(self, name: str) -> bool:
    return name in self.tensors

  def __getitem__(self, name: str):
    if name not in self.tensors:
      raise ValueError(f"checkpoint is missing tensor {name!r}")
    self.used.add(name)
    self.reads.append(name)
    return self.tensors[name]


@dataclasses.dataclass(frozen=True)
class Target:
  """Where one of our parameters goes in a Hugging Face checkpoint (one expert of stacked
  experts).

  Attributes:
    module: the HF module name ("model.layers.0.self_attn.q_proj"); its tensor is
      "<module>.<tensor>" (or weight_packed, ... once quantized).
    linear: whether ours is a linear weight [in, out] (HF stores [out, in]: transposed).
    expert: for stacked experts, the expert index along axis 0 of ours; else None.
    tensor: the tensor's name inside the module ("weight"; Gated DeltaNet's "A_log", ...).
    conv1d: a depthwise conv1d kernel, ours [K, C], HF's [C, 1, K].
  """

  module: str
  linear: bool
  expert: int | None = None
  tensor: str = "weight"
  conv1d: bool = False

  @property
  def name(self) -> str:
    return f"{self.module}.{self.tensor}"


class NameTable:
  """Our parameter paths <-> Hugging Face tensor names of one architecture."""

  def __init__(self, *rows: Name | tuple[Name, ...]):
    flat = [r for row in rows for r in (row if isinstance(row, tuple) else (row,))]
    self.rows: dict[str, Name] = {}
    for row in flat:
      if row.ours in self.rows:
        raise ValueError(f"NameTable: two rows for {row.ours!r}")
      self.rows[row.ours] = row

  @staticmethod
  def _key(path: tuple) -> tuple[str, dict]:
    names = tuple(str(p) for p in path)
    fields = {}
    if len(names) > 1 and names[0] == "blocks":
      fields["layer"] = int(names[1])
      names = ("blocks", "{layer}") + names[2:]
    return ".".join(names), fields

  def __contains__(self, path: tuple) -> bool:
    return self._key(path)[0] in self.rows

  def row(self, path: tuple) -> tuple[Name, dict]:
    """The row of our parameter at NNX `path`, and its placeholders ({"layer": i})."""
    key, fields = self._key(path)
    if key not in self.rows:
      raise ValueError(f"no Hugging Face name for parameter {'.'.join(map(str, path))}")
    return self.rows[key], fields

  def targets(self, path: tuple, num_experts: int) -> Iterator[Target]:
    """Export: the HF tensors of our parameter (one per expert for stacked experts)."""
    row, fields = self.row(path)
    experts = range(num_experts) if row.experts else (None,)
    for e in experts:
      name = row.theirs[0].format(**fields, **({} if e is None else {"expert": e}))
      module, tensor = name.rsplit(".", 1)
      yield Target(module, row.kind == "linear", e, tensor, row.kind == "conv1d")

  def read(self, path: tuple, shape: tuple[int, ...], checkpoint: Checkpoint) -> np.ndarray:
    """Import: our parameter at `path` (of `shape`) from a checkpoint, in our layout.

    Raises:
      ValueError: naming the missing tensor, or an expert's tensor of the wrong shape.
    """
    row, fields = self.row(path)

    def first_present(names):
      return next((n for n in names if n in checkpoint), names[0])

    if not row.experts:
      array = checkpoint[first_present([t.format(**fields) for t in row.theirs])]
      if row.kind == "conv1d":  # [C, 1, K] -> [K, C]
        return _transpose(array[:, 0])
      return _transpose(array) if row.kind == "linear" else array
    if row.fused is not None and row.fused[0].format(**fields) in checkpoint:
      name, part, parts = row.fused
      fused = checkpoint[name.format(**fields)]  # [E, parts * out, in]
      width = fused.shape[1] // parts
      stop = None if part == parts - 1 else (part + 1) * width
      return _transpose(fused[:, part * width : stop])
    expected = (shape[2], shape[1])  # one expert, Hugging Face [out, in]
    stacked = []
    for e in range(shape[0]):
      name = first_present([t.format(**fields, expert=e) for t in row.theirs])
      array = checkpoint[name]
      if tuple(array.shape) != expected:
        raise ValueError(
          f"tensor {name!r} has shape {tuple(array.shape)}; the config implies {expected}"
        )
      stacked.append(_transpose(array))
    return np.stack(stacked)

  def source(self, path: tuple, shape: tuple[int, ...], checkpoint: Checkpoint) -> SliceSource:
    """Import, slice by slice: our parameter at `path` (of `shape`) as a `SliceSource`, whose
    `source[index]` equals `read(path, shape, checkpoint)[index]` and reads only what that
    slice needs from the checkpoint's arrays (any arrays with `shape` and basic slicing:
    memory maps, `compressed.Dequantized`). The same tensors are marked read, in the same
    order, as by `read`; nothing but their headers is read here.

    Raises:
      ValueError: naming the missing tensor, or an expert's tensor of the wrong shape.
    """
    row, fields = self.row(path)

    def first_present(names):
      return next((n for n in names if n in checkpoint), names[0])

    if not row.experts:
      array = checkpoint[first_present([t.format(**fields) for t in row.theirs])]
      held = tuple(array.shape)
      if row.kind == "conv1d" and len(held) == 3:  # [C, 1, K] -> [K, C]
        return SliceSource((held[2], held[0]), lambda i: _transposed_slice(array, (i[1], 0, i[0])))
      if row.kind == "linear" and len(held) >= 2:
        return SliceSource(
          held[:-2] + held[:-3:-1], lambda i: _transposed_slice(array, _swap_last(i))
        )
      return SliceSource(held, lambda i: array[i])
    if row.fused is not None and row.fused[0].format(**fields) in checkpoint:
      name, part, parts = row.fused
      fused = checkpoint[name.format(**fields)]  # [E, parts * out, in]
      if len(fused.shape) != 3:
        return SliceSource(tuple(fused.shape), lambda i: fused[i])
      num, rows, cols = fused.shape
      width = rows // parts
      lo, hi = part * width, rows if part == parts - 1 else (part + 1) * width

      def read_fused(index):
        e, i, o = index
        return _transposed_slice(fused, (e, slice(lo + o.start, lo + o.stop), i))

      return SliceSource((num, cols, hi - lo), read_fused)
    expected = (shape[2], shape[1])  # one expert, Hugging Face [out, in]
    names, arrays = [], []
    for e in range(shape[0]):
      name = first_present([t.format(**fields, expert=e) for t in row.theirs])
      array = checkpoint[name]
      if tuple(array.shape) != expected:
        raise ValueError(
          f"tensor {name!r} has shape {tuple(array.shape)}; the config implies {expected}"
        )
      names.append(name)
      arrays.append(array)

    def read_stacked(index):
      e, i, o = index
      return np.stack([_transposed_slice(arrays[k], (o, i)) for k in range(e.start, e.stop)])

    return SliceSource(tuple(shape), read_stacked, tuple(names))


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
  """`index` (basic slices, one per dimension; missing ones whole) as slices with explicit
  start and stop, of step 1."""
  if len(index) > len(shape):
    raise ValueError(f"index {index} has more entries than shape {shape} has dimensions")
  out = []
  for entry, size in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape):
    if not isinstance(entry, slice):
      raise ValueError(f"index {index}: every entry is a slice; got {entry!r}")
    start, stop, step = entry.indices(size)
    if step != 1:
      raise ValueError(f"index {index}: slices of step 1 only; got step {step}")
    out.append(slice(start, max(start, stop)))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class SliceSource:
  """One of our parameters as a checkpoint holds it, assembled slice by slice: `source[index]`
  is `NameTable.read(...)[index]` (the same values, bit for bit), reading from the
  checkpoint's arrays (memory maps) only the rows and columns the slice needs.

  Attributes:
    shape: the shape the whole parameter has (what `read` would return).
    read: (index of explicit step-1 slices, one per dimension) -> that slice, in our layout.
    expert_names: for one tensor per expert, the tensor of each index along axis 0 (to name
      the one a bad value came from); else None.
  """

  shape: tuple[int, ...]
  read: Callable[[tuple[slice, ...]], np.ndarray]
  expert_names: tuple[str, ...] | None = None

  def bounds(self, index: tuple) -> tuple[slice, ...]:
    """`index` with explicit starts and stops (for a slice of this parameter)."""
    return _bounds(index, self.shape)

  def __getitem__(self, index) -> np.ndarray:
    return np.asarray(self.read(self.bounds(index if isinstance(index, tuple) else (index,))))


def _swap_last(index: tuple) -> tuple:
  return index[:-2] + (index[-1], index[-2])


def _transposed_slice(array, index: tuple) -> np.ndarray:
  """`_transpose(array[index])`, the slice copied out in the stored layout first (one
  sequential read of a memory map rather than a strided one)."""
  return _transpose(np.array(array[index]))


def _same(tensors: dict) -> dict:
  return tensors


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arch:
  """One Hugging Face model family, both directions.

  Attributes:
    name: its `ModelConfig.arch`.
    hf_classes: config.json `architectures` read as this family; the first is written.
    model_types: config.json `model_type` values read as this family.
    names: the two-way tensor name table.
    config_from_hf: (config.json dict, dtype name) -> ModelConfig.
    hf_config: ModelConfig -> config.json dict (`export.names.hf_config` checks that it
      reads back as the same ModelConfig).
    text_tensors: a checkpoint's tensors -> the ones the table names, under its names (a
      published layout's renames and skipped towers); default: as they are.
  """

  name: str
  hf_classes: tuple[str, ...]
  model_types: tuple[str, ...]
  names: NameTable
  config_from_hf: Callable[[dict, str], ModelConfig]
  hf_config: Callable[[ModelConfig], dict]
  text_tensors: Callable[[dict], dict] = _same

  def matches(self, hf: dict) -> bool:
    """Whether a config.json dict is one of this family's."""
    classes = hf.get("architectures") or []
    return hf.get("model_type") in self.model_types or any(a in self.hf_classes for a in classes)


def get_arch(name: str) -> Arch:
  """The `Arch` of `ModelConfig.arch` `name` (its module `archs/<name>.py`)."""
  if name not in ARCHS:
    raise ValueError(f"arch={name!r} is not supported; supported: {ARCHS}")
  return importlib.import_module(f"trace_jax.model.archs.{name}").ARCH


def detect_arch(hf: dict) -> Arch:
  """The `Arch` a config.json dict belongs to (by model_type or architectures).

  Raises:
    ValueError: an unknown family, listing the supported ones.
  """
  archs = [get_arch(name) for name in ARCHS]
  for arch in archs:
    if arch.matches(hf):
      return arch
  supported = ", ".join(f"{a.name} ({', '.join(a.hf_classes)})" for a in archs)
  raise ValueError(
    f"unsupported architecture model_type={hf.get('model_type')!r} "
    f"architectures={hf.get('architectures') or []}; supported: {supported}"
  )
