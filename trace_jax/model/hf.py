"""Load Hugging Face checkpoints of Qwen3-MoE, Qwen3.5-MoE, Mixtral and OLMoE: `from_hf(path)`.

Reads config.json and *.safetensors (one file, or shards through
model.safetensors.index.json) with NumPy memory maps, so no torch or transformers is
needed. Linear weights are stored [out, in] by Hugging Face and [in, out] here; experts
are stacked [E, in, out]. Both on-disk expert layouts exist in the wild: one tensor per
expert (`experts.{e}.gate_proj.weight`, Mixtral's `w1/w2/w3`) and fused 3-D tensors
(`experts.gate_up_proj` [E, 2f, d], `experts.down_proj` [E, d, f]); both load.
Each family's tensor names and config.json fields live in its module of `model.archs`
(the same tables an export writes with).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from trace_jax.model import compressed, sharding
from trace_jax.model.archs import Checkpoint, detect_arch, get_arch
from trace_jax.model.config import ModelConfig
from trace_jax.model.transformer import Transformer
from trace_jax.utils.io import read_json_object, resolve_inside
from trace_jax.utils.safetensors import DTYPES as _DTYPES

_LABELS = {np.dtype(t): label for label, t in _DTYPES.items()}
_FLOAT_LABELS = ("F64", "F32", "F16", "BF16", "F8_E4M3")  # what a weight may be stored as
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Tensors of one .safetensors file as read-only NumPy views of a memory map (the
  header is read; no tensor's data is, until it is used).

  Raises:
    ValueError: naming the file (and the tensor) when it is not a whole safetensors file.
  """
  raw = (
    np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)
  )
  header, base = _safetensors_header(path, raw)
  tensors = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    _check_tensor_entry(path, name, info, len(raw) - base)
    start, end = info["data_offsets"]
    tensors[name] = (
      raw[base + start : base + end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    )
  return tensors


def _safetensors_header(path: str, raw) -> tuple[dict, int]:
  """(header dict, offset of the data) of a safetensors file, or a ValueError naming it."""
  if len(raw) < 8:
    raise ValueError(f"{path}: not a safetensors file ({len(raw)} bytes; truncated?)")
  header_len = int(np.frombuffer(raw[:8].tobytes(), "<u8")[0])
  if header_len > len(raw) - 8:
    raise ValueError(
      f"{path}: the header claims {header_len} bytes but the file has "
      f"{len(raw)} (truncated, or not a safetensors file)"
    )
  try:
    header = json.loads(raw[8 : 8 + header_len].tobytes())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from e
  if not isinstance(header, dict):
    raise ValueError(f"{path}: the safetensors header is not a JSON object")
  return header, 8 + header_len


def _is_index_list(value) -> bool:
  """A JSON list of integers >= 0 (a shape, or data offsets); JSON's true/false are not."""
  return isinstance(value, list) and all(
    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
  )


def _check_tensor_entry(path: str, name: str, info, data_bytes: int) -> None:
  """A header entry that the file can actually back (dtype, shape, offsets in range)."""
  where = f"{path}: tensor {name!r}"
  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
    raise ValueError(
      f"{where} has a malformed header entry {repr(info)[:200]} (an entry holds "
      "'dtype', 'shape' and 'data_offsets')"
    )
  dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
  if not isinstance(dtype, str) or dtype not in _DTYPES:
    raise ValueError(f"{where} has unsupported dtype {dtype}; supported: {sorted(_DTYPES)}")
  if not _is_index_list(shape):
    raise ValueError(f"{where} has shape {repr(shape)[:200]}; a shape is a list of integers >= 0")
  if not _is_index_list(offsets) or len(offsets) != 2:
    raise ValueError(
      f"{where} has data_offsets {repr(offsets)[:200]}; data_offsets is a list of two "
      "integers [start, end] >= 0"
    )
  start, end = offsets
  expected = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
  if not 0 <= start <= end <= data_bytes or end - start != expected:
    raise ValueError(
      f"{where} ({dtype} {shape}, {expected} bytes) "
      f"has data offsets [{start}, {end}) but the file holds {data_bytes} data "
      f"bytes (truncated or damaged file)"
    )


def _index_files(index_path: str) -> list[str]:
  """The shard file names a model.safetensors.index.json names, or a ValueError naming it."""
  weight_map = read_json_object(index_path).get("weight_map")
  if not isinstance(weight_map, dict):
    raise ValueError(
      f"{index_path}: weight_map is {repr(weight_map)[:80]}; it must be an object "
      "of tensor name -> shard file name"
    )
  for tensor, file in weight_map.items():
    if not isinstance(file, str) or not file:
      raise ValueError(
        f"{index_path}: weight_map[{tensor!r}] is {repr(file)[:80]}; it must be a shard file name"
      )
  return sorted(set(weight_map.values()))


def checkpoint_file(directory: str, name: str) -> str:
  """`directory/name`, once it is checked to resolve inside the checkpoint directory.

  A checkpoint reads only its own files: a name (an index entry) with "..", an absolute
  one, or a symlink out of the directory is refused. One layout links out by design: a
  Hugging Face hub cache snapshot (`<repo>/snapshots/<revision>/<name>`) links each file
  to `<repo>/blobs/`; those links are followed.

  Raises:
    ValueError: naming the file and where it resolves to.
  """
  resolve_inside(directory, name)  # (the hub cache's links to its blobs pass)
  return os.path.join(directory, name)


def shard_files(path: str) -> list[str]:
  """The paths of a checkpoint directory's safetensors files: the ones its
  model.safetensors.index.json names, else every *.safetensors file in it.

  Raises:
    ValueError: a damaged index, a shard it names that is missing, or a file that
      resolves outside the directory (`checkpoint_file`), named.
  """
  index = os.path.join(path, "model.safetensors.index.json")
  if not os.path.exists(index):
    names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return [checkpoint_file(path, name) for name in names]
  files = []
  for name in _index_files(checkpoint_file(path, "model.safetensors.index.json")):
    try:
      file = checkpoint_file(path, name)
    except ValueError as e:
      raise ValueError(f"{index}: weight_map names {name!r}: {e}") from e
    if not os.path.isfile(file):
      raise ValueError(f"{index}: weight_map names {name!r}, which is not a file in {path}")
    files.append(file)
  return files


def _read_checkpoint_files(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """(every tensor of a checkpoint directory by name, the file each came from)."""
  files = shard_files(path)
  if not files:
    raise ValueError(f"{path} holds no *.safetensors files")
  tensors, origin = {}, {}
  for file in files:
    for tensor, array in read_safetensors(file).items():
      if tensor in origin:
        raise ValueError(f"tensor {tensor!r} is in both {origin[tensor]} and {file}")
      tensors[tensor], origin[tensor] = array, file
  return tensors, origin


def _read_checkpoint(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint directory (one file, or shards through the index)."""
  return _read_checkpoint_files(path)[0]


def config_from_hf(hf: dict, dtype=jnp.float32) -> ModelConfig:
  """A ModelConfig from a Hugging Face config.json dict (either spelling of each field)."""
  dtype_name = "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"
  return detect_arch(hf).config_from_hf(hf, dtype_name)


def read_config(config_path: str, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
  """config_from_hf of a config.json file, and the file's dict, with errors that name it.

  Raises:
    ValueError: naming the file: not a JSON object, a required field missing, a field of
      the wrong type or value.
  """
  hf = read_json_object(config_path)
  try:
    return config_from_hf(hf, dtype), hf
  except KeyError as e:
    raise ValueError(f"{config_path} lacks the required field {e.args[0]!r}") from e
  except (ValueError, TypeError, AttributeError) as e:  # e.g. a list where an object belongs
    raise ValueError(f"{config_path}: {e}") from e


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"model\.layers\.\d+\..*\.experts\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"model\.layers\.\d+\..*\.experts\.(gate_up_proj|down_proj)$")


def _check_config_claims(config_path: str, hf: dict, cfg: ModelConfig, tensors: dict) -> None:
  """Refuse a config.json whose sizes the checkpoint's tensors contradict: the number of
  layers and of routed experts (from the tensor names), the hidden size and the vocabulary
  (from the embedding's shape). Only the safetensors headers are read, and nothing is
  built: a config claiming 10000 layers over files holding 2 would otherwise keep the
  abstract model's construction busy for minutes before the first tensor is compared.

  Raises:
    ValueError: naming config.json, each field, its value and what the files hold.
  """
  text = hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf
  field = lambda name: f"text_config.{name}" if text is not hf else name  # noqa: E731
  problems = []
  layers = [int(m.group(1)) for n in tensors if (m := _LAYER.match(n))]
  held = max(layers) + 1 if layers else 0
  if held != cfg.num_layers:
    holds = f"{held} (model.layers.0 to {held - 1})" if held else "no model.layers.* tensors"
    problems.append(f"{field('num_hidden_layers')}={cfg.num_layers} but the files hold {holds}")
  experts = [int(m.group(1)) + 1 for n in tensors if (m := _EXPERT.match(n))]
  experts += [
    tensors[n].shape[0] for n in tensors if _FUSED_EXPERTS.match(n) and tensors[n].ndim == 3
  ]
  if experts and max(experts) != cfg.num_experts:
    name = "num_experts" if "num_experts" in text else "num_local_experts"
    problems.append(f"{field(name)}={cfg.num_experts} but the files hold {max(experts)} experts")
  embed = tensors.get("model.embed_tokens.weight")
  if embed is not None and embed.ndim == 2:
    vocab, width = embed.shape
    if width != cfg.d_model:
      problems.append(
        f"{field('hidden_size')}={cfg.d_model} but model.embed_tokens.weight is [{vocab}, {width}]"
      )
    if vocab != cfg.vocab_size:
      problems.append(
        f"{field('vocab_size')}={cfg.vocab_size} but model.embed_tokens.weight is "
        f"[{vocab}, {width}]"
      )
  if problems:
    raise ValueError(
      f"{config_path}: {'; '.join(problems)} ; the config does not describe these weights"
    )


def _nonfinite_count(array) -> int:
  """NaN and Inf values of an array as float32 (what the loader keeps)."""
  return int(np.size(array) - np.isfinite(np.asarray(array, np.float32)).sum())


def _check_float_weights(hf: dict, tensors: dict, file_of) -> None:
  """Refuse a tensor stored as an integer or boolean dtype: every weight this loader reads
  is a float (an I32-labelled lm_head would otherwise load its float bytes as integers);
  a compressed-tensors checkpoint's packed fields are checked by `compressed`."""
  packed = compressed.quantized_format(hf) is not None
  for name, array in tensors.items():
    if name.endswith(_IGNORED_SUFFIXES) or (
      packed and name.rsplit(".", 1)[-1] in compressed.FIELDS
    ):
      continue
    label = _LABELS.get(array.dtype, str(array.dtype))
    if label not in _FLOAT_LABELS:
      raise ValueError(
        f"{file_of(name)}: tensor {name!r} has dtype {label}; a weight must be stored as "
        f"one of {list(_FLOAT_LABELS)}"
      )


def _memory_maps(tensors: dict) -> list:
  """The distinct memory maps the checkpoint's arrays view."""
  maps = {id(m): m for a in tensors.values() if (m := getattr(a, "_mmap", None)) is not None}
  return list(maps.values())


def _release_pages(maps: list) -> None:
  """Drop the pages of the checkpoint's memory maps from this process's resident set (the
  kernel's page cache keeps them; a later read maps them again): what a slice read touched
  is not held on to while the next parameter loads."""
  for m in maps:
    try:
      m.madvise(mmap.MADV_DONTNEED)
    except (AttributeError, OSError, ValueError):  # a platform without madvise, a closed map
      pass


_EXPONENT_BITS = {np.dtype(jnp.bfloat16): 0x7F80, np.dtype(np.float16): 0x7C00}


def _all_finite(block: np.ndarray) -> bool:
  """Whether a float array holds no NaN or Inf (16-bit floats: from their exponent bits)."""
  bits = _EXPONENT_BITS.get(block.dtype)
  if bits is None:
    return bool(np.isfinite(block).all())
  return not np.any((block.view(np.uint16) & bits) == bits)


def _slice_text(index: tuple[slice, ...]) -> str:
  return "[" + ", ".join(f"{s.start}:{s.stop}" for s in index) + "]"


def _slice_reader(source, sources, tensors, named, name, dtype, allow_nonfinite):
  """The `make_array_from_callback` callback of one parameter: its slice `index`, read from
  `source` as float32 (as the whole-tensor load keeps it), checked finite, cast to `dtype`;
  a slice several local devices hold is read once."""
  done = {}

  def read(index):
    bounds = source.bounds(index)
    key = tuple((s.start, s.stop) for s in bounds)
    if key not in done:
      block = np.asarray(source.read(bounds))
      if block.dtype == np.dtype(dtype) and _all_finite(block):  # e.g. bf16 on disk and here:
        done[key] = np.ascontiguousarray(block)  # as its float32 round trip would give
        return done[key]
      block = np.asarray(block, np.float32)
      if not allow_nonfinite and not np.isfinite(block).all():
        culprits = sources
        if source.expert_names is not None:  # the experts in this slice with bad values
          rows = (~np.isfinite(block)).reshape(block.shape[0], -1).any(axis=1)
          culprits = [source.expert_names[bounds[0].start + k] for k in np.flatnonzero(rows)]
        raise ValueError(
          f"tensor {named(culprits, tensors)} holds {_nonfinite_count(block)} NaN or Inf "
          f"values (read as {name}{_slice_text(bounds)}): non-finite weights are refused "
          "(from_hf(..., allow_nonfinite=True) loads them, for debugging)"
        )
      done[key] = block.astype(jnp.dtype(dtype))
    return done[key]

  return read


def from_hf(
  path: str,
  dtype=jnp.float32,
  *,
  allow_nonfinite: bool = False,
  mesh: Mesh | None = None,
  **overrides,
) -> Transformer:
  """A Transformer with the weights of a local Hugging Face checkpoint directory.

  Args:
    path: directory with config.json and *.safetensors (sharded index too); a
      compressed-tensors FP4 checkpoint loads dequantized (`model.compressed`).
    dtype: parameter and compute dtype (float32 or bfloat16).
    allow_nonfinite: load weights that hold NaN or Inf (for debugging a damaged
      checkpoint); refused by default, naming the tensor.
    mesh: make every parameter directly in its final sharding on this (data, expert,
      model) mesh (the rule it declares, `sharding.param_spec`), with
      `jax.make_array_from_callback`: each process reads from the files only the slices its
      own devices hold (transposes, expert stacking, the fused gate/up split and FP4
      dequantization are done per slice, bit for bit as the whole-tensor load), so no
      process holds a whole tensor its devices do not need; works under `jax.distributed`.
      The non-finite check is then per slice. None: every parameter whole on the default
      device.
    **overrides: ModelConfig fields a checkpoint does not hold, how this run computes
      (e.g. remat=True); they change no weight's shape.

  Raises:
    ValueError: unknown architecture (listing the supported ones), a config.json the
      tensors contradict, a missing tensor, a tensor of the wrong shape or of a dtype that
      is not a float, a non-finite weight, or tensors in the checkpoint that nothing loads.
  """
  path = os.path.abspath(path)
  if not os.path.exists(os.path.join(path, "config.json")):
    raise ValueError(f"{path} has no config.json")
  config_path = checkpoint_file(path, "config.json")
  cfg, hf = read_config(config_path, dtype)
  cfg = cfg.replace(**overrides)
  arch = get_arch(cfg.arch)
  raw, origin = _read_checkpoint_files(path)
  tensors = arch.text_tensors(raw)  # e.g. Qwen3.5's published layout
  files = {id(raw[name]): file for name, file in origin.items()}  # text_tensors keeps arrays

  def named(names, among) -> str:
    """Tensors and the files they came from (a dequantized FP4 weight: the directory)."""
    shown = ", ".join(f"{n!r} in {files.get(id(among[n]), path)}" for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")

  _check_config_claims(config_path, hf, cfg, tensors)  # headers only, before anything is built
  _check_float_weights(hf, tensors, lambda name: files.get(id(tensors[name]), path))
  # FP4 checkpoints: dequantized (with a mesh, slice by slice as each is read).
  checkpoint = Checkpoint(compressed.decompress(hf, tensors, lazy=mesh is not None))

  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(state))
  missing_from_map = [p for p in flat if p not in arch.names]
  if missing_from_map:
    raise ValueError(f"no checkpoint mapping for parameters {missing_from_map}")
  maps = _memory_maps(raw)
  specs = {  # a rule the mesh cannot follow is refused before any tensor is read
    p: sharding.param_spec(v, mesh, what="parameter " + ".".join(map(str, p)))
    for p, v in (flat.items() if mesh is not None else ())
  }
  for param_path, variable in flat.items() if mesh is None else ():
    expected = variable.get_value().shape
    first = len(checkpoint.reads)
    array = np.asarray(arch.names.read(param_path, expected, checkpoint), dtype=np.float32)
    sources = list(dict.fromkeys(checkpoint.reads[first:]))
    name = ".".join(str(p) for p in param_path)
    if array.shape != expected:
      raise ValueError(
        f"tensor for {name} has shape {array.shape} ({named(sources, checkpoint.tensors)}); "
        f"the config implies {expected}"
      )
    if not allow_nonfinite and not np.isfinite(array).all():
      bad = {n: c for n in sources if (c := _nonfinite_count(checkpoint.tensors[n]))}
      raise ValueError(
        f"tensor {named(list(bad) or sources, checkpoint.tensors)} holds "
        f"{sum(bad.values()) or _nonfinite_count(array)} NaN or Inf values (read as {name}): "
        "non-finite weights are refused "
        "(from_hf(..., allow_nonfinite=True) loads them, for debugging)"
      )
    variable.set_value(jnp.asarray(array, dtype))
  for param_path, variable in flat.items() if mesh is not None else ():
    name = ".".join(str(p) for p in param_path)
    expected = tuple(variable.get_value().shape)
    first = len(checkpoint.reads)
    source = arch.names.source(param_path, expected, checkpoint)
    sources = list(dict.fromkeys(checkpoint.reads[first:]))
    if source.shape != expected:
      raise ValueError(
        f"tensor for {name} has shape {source.shape} ({named(sources, checkpoint.tensors)}); "
        f"the config implies {expected}"
      )
    variable.set_value(
      jax.make_array_from_callback(
        expected,
        NamedSharding(mesh, specs[param_path]),
        _slice_reader(source, sources, checkpoint.tensors, named, name, dtype, allow_nonfinite),
      )
    )
    _release_pages(maps)
  unused = sorted(
    n for n in set(checkpoint.tensors) - checkpoint.used if not n.endswith(_IGNORED_SUFFIXES)
  )
  if unused:
    raise ValueError(f"checkpoint tensors that nothing loads (wrong architecture?): {unused[:8]}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))
