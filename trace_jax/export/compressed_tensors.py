"""Export an FP4 policy as a compressed-tensors checkpoint that vLLM and SGLang serve.

The files hold the rollout's bytes: the packed weights are `quantize_params` of the policy
(the same QArrays the rollout engine multiplies with), only transposed to the Hugging Face
[out, in] layout and split per expert. Per quantized linear (compressed-tensors names):
  NVFP4  weight_packed        uint8 [out, in/2], element 2i in the low nibble
         weight_scale         float8_e4m3fn [out, in/16]
         weight_global_scale  float32 [1], the encode scale gs = 448 * 6 / amax (the
                              decoder divides by it: x = code * scale / gs)
         input_global_scale   float32 [1], only for the W4A4 scheme (static, calibrated)
  MXFP4  weight_packed        uint8 [out, in/2]
         weight_scale         uint8 [out, in/32], E8M0 exponents (bias 127)
Everything else (embedding, norms, router, LM head, and the linears the QuantConfig keeps
in high precision) is written in bf16 under its HF name; the Linear ones are in `ignore`.

KV cache: `kv_cache_scheme` is null. compressed-tensors' KV scheme carries static
per-tensor k/v scales (what vLLM reads for an FP8 KV cache); our rollout's FP4 K/V, quantized
per (token, KV head) with dynamic scales, has no counterpart there, so a server keeps the KV
precision of its own `--kv-cache-dtype` (bf16, or fp8 with scales of 1): the served policy
differs from the rollout in its KV cache unless the engine adds an FP4 KV mode.

Algorithm:
  1. packed = quantize_params(state, quant): q/k/v of a layer and gate/up of an expert
     already share one global scale (fused serving kernels need it);
  2. every parameter is mapped to its HF tensors (`names.targets`) and written to
     safetensors shards (+ model.safetensors.index.json when there are several), tensor
     by tensor: the header is planned from shapes, and each tensor (one expert's slice of
     stacked experts) is fetched from the devices when its bytes are written, then
     dropped, so a host never holds more than one tensor of a sharded policy;
  3. config.json = the source's (or one made from the ModelConfig) + quantization_config;
     tokenizer and generation files are copied from the source directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from trace_jax import fp4
from trace_jax.export import names as names_lib
from trace_jax.model import parameters
from trace_jax.model.quant import QuantConfig
from trace_jax.model.transformer import Transformer
from trace_jax.rollout.params import quantize_params
from trace_jax.utils import safetensors
from trace_jax.utils.io import (
  atomic_directory,
  check_replaceable_folder,
  resolve_inside,
  write_atomic,
  write_json,
)

FORMATS = ("nvfp4", "mxfp4")
ACTIVATIONS = ("none", "nvfp4", "mxfp4")
UNQUANTIZED_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
COPIED_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "generation_config.json",
  "chat_template.jinja",
  "chat_template.json",
  "vocab.json",
  "merges.txt",
  "tokenizer.model",
)
# The file that marks a folder as this tool's export (`export_compressed_tensors` with
# summary_extra, as experiments/export.py writes), and the fields every such summary holds.
SUMMARY_FILE = "export_summary.json"
_SUMMARY_KEYS = ("out_dir", "files", "copied", "tensors", "bytes", "quantization_config")
# Every name an export writes in its folder.
_EXPORT_NAMES = ("config.json", "model.safetensors.index.json", SUMMARY_FILE, *COPIED_FILES)
_SHARD_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
# The dtypes an export writes, with their safetensors codes.
_SAFETENSORS_DTYPES = safetensors.codes_of(("F32", "BF16", "U8", "F8_E4M3", "F16"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportConfig:
  """How a policy is written as compressed-tensors."""

  fmt: str = "nvfp4"  # weight format: "nvfp4" or "mxfp4"
  activations: str = "none"  # "none": weight-only (W4A16); "nvfp4" / "mxfp4": W4A4
  unquantized_dtype: str = "bfloat16"  # dtype of the tensors that are not FP4
  max_shard_bytes: int = 4 << 30  # safetensors shard size

  def __post_init__(self):
    if self.fmt not in FORMATS:
      raise ValueError(f"ExportConfig.fmt={self.fmt!r} is not allowed; use one of {FORMATS}")
    if self.activations not in ACTIVATIONS:
      raise ValueError(
        f"ExportConfig.activations={self.activations!r} is not allowed; use one of {ACTIVATIONS}"
      )
    if self.activations not in ("none", self.fmt):
      raise ValueError(
        f"ExportConfig.activations={self.activations!r} with fmt={self.fmt!r}: "
        "W4A4 activations use the weights' format"
      )
    if self.unquantized_dtype not in UNQUANTIZED_DTYPES:
      raise ValueError(
        f"ExportConfig.unquantized_dtype={self.unquantized_dtype!r} is not "
        f"allowed; use one of {sorted(UNQUANTIZED_DTYPES)}"
      )
    if self.max_shard_bytes <= 0:
      raise ValueError(f"ExportConfig.max_shard_bytes={self.max_shard_bytes} must be > 0")

  @property
  def static_input_scales(self) -> bool:
    """NVFP4 W4A4 stores a calibrated input_global_scale; MXFP4 activations have none."""
    return self.activations == "nvfp4"


def format_name(fmt: str) -> str:
  return f"{fmt}-pack-quantized"


def _scheme(config: ExportConfig) -> dict:
  """One config group of quantization_config (compressed-tensors QuantizationScheme)."""
  if config.fmt == "nvfp4":
    args = dict(
      num_bits=4,
      type="float",
      symmetric=True,
      strategy="tensor_group",
      group_size=16,
      scale_dtype="torch.float8_e4m3fn",
      zp_dtype="torch.float8_e4m3fn",
    )
  else:
    args = dict(
      num_bits=4,
      type="float",
      symmetric=True,
      strategy="group",
      group_size=32,
      scale_dtype="torch.uint8",
      zp_dtype="torch.uint8",
    )
  weights = dict(args, dynamic=False, observer="minmax")
  inputs = None
  if config.activations == "nvfp4":  # dynamic block scales, static (calibrated) global scale
    inputs = dict(args, dynamic="local", observer="static_minmax")
  elif config.activations == "mxfp4":
    inputs = dict(args, dynamic=True, observer=None)
  return dict(
    targets=["Linear"],
    weights=weights,
    input_activations=inputs,
    output_activations=None,
    format=format_name(config.fmt),
  )


def quantization_config(config: ExportConfig, ignore: list[str]) -> dict:
  """The `quantization_config` entry of config.json."""
  return {
    "quant_method": "compressed-tensors",
    "format": format_name(config.fmt),
    "quantization_status": "compressed",
    "config_groups": {"group_0": _scheme(config)},
    "ignore": ignore,
    "kv_cache_scheme": None,
    "global_compression_ratio": None,
  }


def _to_numpy(value) -> np.ndarray:
  """One array on this host: `jax.device_get` of the shards this process holds, or, for an
  array spanning processes, `process_allgather` of just that array."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.asarray(jax.device_get(value))


@dataclasses.dataclass(frozen=True)
class HFTensor:
  """One tensor of the export, not yet on the host: its dtype and shape, and `make`, which
  fetches just this tensor from the devices (one expert's slice of stacked experts) and
  gives it in the HF layout."""

  dtype: np.dtype
  shape: tuple[int, ...]
  make: Callable[[], np.ndarray]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _hf_shape(shape: tuple[int, ...], target: names_lib.Target) -> tuple[int, ...]:
  """The shape `names.hf_array` gives an array of `shape` (a zero-byte view stands in)."""
  return tuple(names_lib.hf_array(np.broadcast_to(np.zeros((), np.uint8), shape), target).shape)


def _selected(value, target: names_lib.Target):
  """`value` (a device array) cut to `target`'s expert, on the device."""
  return value if target.expert is None else value[target.expert]


def _lazy(value, target: names_lib.Target, dtype, convert=None) -> HFTensor:
  """The HF tensor of `target` made from device array `value` when it is written."""
  local = dataclasses.replace(target, expert=None)

  def make() -> np.ndarray:
    array = names_lib.hf_array(_to_numpy(_selected(value, target)), local)
    return convert(array) if convert is not None else np.ascontiguousarray(array.astype(dtype))

  return HFTensor(np.dtype(dtype), _hf_shape(value.shape, target), make)


def _packed_tensors(q: fp4.QArray, target: names_lib.Target) -> dict[str, HFTensor]:
  """compressed-tensors fields of one packed linear (one expert of stacked experts)."""
  out = {"weight_packed": _lazy(q.packed, target, np.uint8)}  # [out, in/2]
  if q.format.has_global_scale:  # [out, in/block] E4M3 bits
    e4m3 = ml_dtypes.float8_e4m3fn
    out["weight_scale"] = _lazy(
      q.scales, target, e4m3, lambda a: np.ascontiguousarray(a).view(e4m3)
    )
    gs = q.global_scale

    def global_scale() -> np.ndarray:
      return np.asarray(_to_numpy(_selected(gs, target)), np.float32).reshape(1)

    out["weight_global_scale"] = HFTensor(np.dtype(np.float32), (1,), global_scale)
  else:
    out["weight_scale"] = _lazy(q.scales, target, np.uint8)
  return out


def _constant(array: np.ndarray) -> HFTensor:
  return HFTensor(array.dtype, tuple(array.shape), lambda: array)


def _input_site(path: tuple, variable) -> str:
  """The activation site whose values the linear at `path` multiplies, as its module
  declared it (`parameters.input_site`)."""
  site = parameters.input_site(variable)
  if site is None:
    raise ValueError(f"no activation site known for the linear {'.'.join(map(str, path))}")
  return site


def hf_tensor_plan(
  policy: Transformer,
  config: ExportConfig,
  *,
  quant: QuantConfig | None = None,
  input_scales: Mapping[tuple[int, str], float] | None = None,
) -> tuple[dict[str, HFTensor], list[str]]:
  """Every tensor of the export by HF name, as an `HFTensor` (its bytes stay on the
  devices until it is written), and the ignore list (Linear modules kept in high
  precision). Every refusal is raised here, before anything is written.

  Args:
    policy: the Transformer (float32 master weights, or packed ones loaded from FP4).
    config: ExportConfig.
    quant: the rollout's QuantConfig (its scope decides which linears are FP4); default
      every linear in `config.fmt`.
    input_scales: (layer, site) -> static input global scale, for NVFP4 W4A4.
  """
  cfg = policy.cfg
  quant = quant or QuantConfig(fmt=config.fmt)
  if quant.fmt != config.fmt or not quant.enabled:
    raise ValueError(f"quant={quant} does not quantize in fmt={config.fmt!r}")
  packed = quantize_params(nnx.state(policy), quant)
  dtype = UNQUANTIZED_DTYPES[config.unquantized_dtype]
  tensors: dict[str, HFTensor] = {}
  ignore: list[str] = []
  for path, variable in nnx.to_flat_state(packed):
    value = variable.get_value()
    is_packed = isinstance(value, fp4.QArray)
    if is_packed and not bool(jnp.all(jnp.isfinite(value.global_scale))):
      raise ValueError(
        f"parameter {'.'.join(map(str, path))} holds NaN or Inf: refusing to export a broken policy"
      )
    if is_packed and config.activations != "none":
      site = _input_site(path, variable)
      if not quant.quantizes(site):
        raise ValueError(
          f"activations={config.activations!r}: the linear "
          f"{'.'.join(map(str, path))} has FP4 weights but its input site "
          f"{site!r} is not quantized by the QuantConfig; export weight-only"
        )
    for target in names_lib.targets(cfg, path):
      if is_packed:
        fields = _packed_tensors(value, target)
        if config.static_input_scales:
          layer = int(path[1])
          site = _input_site(path, variable)
          if input_scales is None or (layer, site) not in input_scales:
            raise ValueError(
              f"activations='nvfp4' needs input_scales for (layer {layer}, site "
              f"{site!r}); calibrate them (calibrate_input_scales)"
            )
          scale = np.asarray([input_scales[(layer, site)]], np.float32)
          fields["input_global_scale"] = _constant(scale)
        tensors.update({f"{target.module}.{k}": v for k, v in fields.items()})
      else:
        tensors[target.name] = _lazy(value, target, dtype)
        if target.linear:
          ignore.append(target.module)
  return tensors, ignore


def hf_tensors(
  policy: Transformer,
  config: ExportConfig,
  *,
  quant: QuantConfig | None = None,
  input_scales: Mapping[tuple[int, str], float] | None = None,
) -> tuple[dict[str, np.ndarray], list[str]]:
  """`hf_tensor_plan` with every tensor on the host at once (small policies; an export
  writes tensor by tensor instead)."""
  plan, ignore = hf_tensor_plan(policy, config, quant=quant, input_scales=input_scales)
  return {name: tensor.make() for name, tensor in plan.items()}, ignore


def _spec(array: np.ndarray | HFTensor) -> tuple[np.dtype, tuple[int, ...], int]:
  return array.dtype, tuple(array.shape), int(array.nbytes)


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray | HFTensor]) -> None:
  """One .safetensors file (header JSON, then the raw little-endian bytes), atomically.
  The header is made from the tensors' dtypes and shapes; an `HFTensor` is fetched when
  its bytes are written and dropped right after, so the host holds one tensor at a time."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name in sorted(tensors):
    dtype, shape, nbytes = _spec(tensors[name])
    if dtype not in _SAFETENSORS_DTYPES:
      raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors code")
    header[name] = {
      "dtype": _SAFETENSORS_DTYPES[dtype],
      "shape": list(shape),
      "data_offsets": [offset, offset + nbytes],
    }
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # align the data to 8 bytes

  def chunks():
    yield len(blob).to_bytes(8, "little") + blob
    for name in sorted(tensors):
      tensor = tensors[name]
      array = tensor.make() if isinstance(tensor, HFTensor) else tensor
      dtype, shape, _ = _spec(tensor)
      if array.dtype != dtype or tuple(array.shape) != shape:
        raise AssertionError(f"tensor {name!r} made {array.dtype}{array.shape}, not {dtype}{shape}")
      yield memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
      del array

  write_atomic(path, chunks())


def _shards(tensors: Mapping[str, np.ndarray | HFTensor], max_bytes: int) -> list[list[str]]:
  """Tensor names in shards of at most max_bytes (a larger tensor gets a shard alone),
  keeping a module's tensors together."""
  modules: dict[str, list[str]] = {}
  for name in sorted(tensors):
    modules.setdefault(name.rsplit(".", 1)[0], []).append(name)
  shards, current, size = [], [], 0
  for group in modules.values():
    group_bytes = sum(tensors[n].nbytes for n in group)
    if current and size + group_bytes > max_bytes:
      shards.append(current)
      current, size = [], 0
    current += group
    size += group_bytes
  return shards + [current] if current else shards


def export_compressed_tensors(
  policy: Transformer,
  out_dir: str,
  *,
  source: str | None = None,
  fmt: str = "nvfp4",
  activations: str = "none",
  quant: QuantConfig | None = None,
  input_scales: Mapping[tuple[int, str], float] | None = None,
  unquantized_dtype: str = "bfloat16",
  max_shard_bytes: int = ExportConfig.max_shard_bytes,
  summary_extra: Mapping[str, Any] | None = None,
) -> dict:
  """Write `policy` as a compressed-tensors FP4 checkpoint directory.

  The folder is written whole or not at all (`utils.io.atomic_directory`): built beside
  `out_dir`, fsynced, then renamed into place. An earlier export there (one that carries
  its export_summary.json) is replaced whole, so no shard or index file of it survives;
  a folder that holds anything else, or a symbolic link, is refused (`check_out_dir`).
  Every file read from `source` must resolve inside it (`utils.io.resolve_inside`): a link
  to a file elsewhere is refused, never copied into the export.

  Args:
    policy: the trained Transformer.
    out_dir: output directory: new, empty, or an earlier export with its summary file
      (replaced whole).
    source: the HF checkpoint directory the policy came from: its config.json is the base
      of ours, and its tokenizer / generation / chat-template files are copied. Without it,
      config.json is made from the ModelConfig (`names.hf_config`).
    fmt: "nvfp4" or "mxfp4".
    activations: "none" (weight-only W4A16, the default), or the format for W4A4 ("nvfp4"
      needs `input_scales` from `calibration.calibrate_input_scales`).
    quant: the rollout's QuantConfig (its scope decides which linears are FP4).
    input_scales: (layer, site) -> input_global_scale for NVFP4 W4A4.
    unquantized_dtype: "bfloat16" (as served) or "float32" (the master values exactly).
    max_shard_bytes: safetensors shard size.
    summary_extra: fields added to the summary; when given, the summary is also written to
      export_summary.json in the folder (with the rest, atomically).

  Returns:
    A summary: files, tensor count, bytes, the quantization_config.
  """
  config = ExportConfig(
    fmt=fmt,
    activations=activations,
    unquantized_dtype=unquantized_dtype,
    max_shard_bytes=max_shard_bytes,
  )
  check_out_dir(out_dir, source)
  copied = {}  # name -> the resolved file it is copied from
  if source is not None:
    copied = source_files(source)
    with open(copied.pop("config.json")) as f:
      hf = json.load(f)
    hf.pop("quantization_config", None)
  else:
    hf = names_lib.hf_config(policy.cfg)
  tensors, ignore = hf_tensor_plan(policy, config, quant=quant, input_scales=input_scales)
  hf["quantization_config"] = quantization_config(config, ignore)
  shards = _shards(tensors, config.max_shard_bytes)
  files = (
    ["model.safetensors"]
    if len(shards) == 1
    else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )
  summary = {
    "out_dir": os.path.abspath(out_dir),
    "files": files,
    "copied": [],
    "tensors": len(tensors),
    "bytes": int(sum(a.nbytes for a in tensors.values())),
    "quantization_config": hf["quantization_config"],
  }
  with atomic_directory(out_dir) as staging:
    if len(shards) == 1:
      write_safetensors(os.path.join(staging, files[0]), tensors)
    else:
      weight_map = {}
      for name, shard in zip(files, shards):
        write_safetensors(os.path.join(staging, name), {n: tensors[n] for n in shard})
        weight_map.update({n: name for n in shard})
      write_json(
        os.path.join(staging, "model.safetensors.index.json"),
        {"metadata": {"total_size": summary["bytes"]}, "weight_map": weight_map},
      )
    write_json(os.path.join(staging, "config.json"), hf)
    for name, path in copied.items():
      shutil.copyfile(path, os.path.join(staging, name))
      summary["copied"].append(name)
    if summary_extra is not None:
      summary.update(summary_extra)
      write_json(os.path.join(staging, SUMMARY_FILE), summary)
  return summary


def _source_file(source: str, name: str) -> str | None:
  """The resolved path of the source's file `name`, None where it has none.

  Raises:
    ValueError: the file leads outside the source folder (`resolve_inside`), or is not a
      regular file (a dangling link, a folder, a device).
  """
  if not os.path.lexists(os.path.join(source, name)):
    return None
  path = resolve_inside(source, name)
  if not os.path.isfile(path):
    raise ValueError(
      f"{os.path.join(source, name)} is not a regular file (it resolves to {path}); the "
      "export copies it from the source: replace it with the file itself or remove it"
    )
  return path


def source_files(source: str) -> dict[str, str]:
  """The files an export reads from `source`, by name, each resolved (`resolve_inside`):
  config.json, then those of COPIED_FILES it has.

  Raises:
    ValueError: no config.json, or a file that leads outside `source` or is not a regular
      file (naming it).
  """
  files = {n: p for n in ("config.json", *COPIED_FILES) if (p := _source_file(source, n))}
  if "config.json" not in files:
    raise ValueError(f"source={source!r} has no config.json")
  return files


def _foreign_entries(folder: str) -> list[str] | None:
  """None when `folder` holds no export of this tool (no readable summary file with the
  fields it writes); else the entries in it that no export writes (empty for an export
  left as it was written)."""
  try:
    with open(os.path.join(folder, SUMMARY_FILE)) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(summary, dict) or not all(k in summary for k in _SUMMARY_KEYS):
    return None
  return sorted(
    entry
    for entry in os.listdir(folder)
    if not (
      os.path.isfile(os.path.join(folder, entry))
      and (entry in _EXPORT_NAMES or _SHARD_NAME.fullmatch(entry))
    )
  )


def check_out_dir(out_dir: str, source: str | None = None) -> None:
  """Refuse an output folder that the export may not replace whole; nothing is written.

  Allowed: a folder that does not exist yet, an empty one, or an earlier export of this
  tool holding only the files an export writes (it carries `export_summary.json`). A
  folder holding anything else (a downloaded checkpoint, quantized or not, notes added
  to an export) is refused, as are a symbolic link (the export is renamed into place,
  which would replace the link), a file, and a folder that holds the source checkpoint.

  Raises:
    ValueError: naming `out_dir` and what in it is refused.
  """
  path = os.path.abspath(out_dir)
  check_replaceable_folder(path, f"out_dir={out_dir!r}", "; use a new or empty one")
  out = os.path.realpath(path)
  if source is not None:
    src = os.path.realpath(source)
    if src == out or src.startswith(out + os.sep):
      raise ValueError(f"out_dir={out_dir!r} holds the source checkpoint {source!r}")
  if not os.path.isdir(out) or not os.listdir(out):
    return
  foreign = _foreign_entries(out)
  if foreign is None:
    raise ValueError(
      f"out_dir={out_dir!r} exists and holds files but no earlier export of this tool (no "
      f"{SUMMARY_FILE} in it); the export replaces its folder whole: use a new or empty one"
    )
  if foreign:
    raise ValueError(
      f"out_dir={out_dir!r} is an earlier export but also holds {foreign}, which no export "
      "writes; the export replaces its folder whole: move them out, or use a new folder"
    )


def tensor_listing(out_dir: str) -> list[tuple[str, str, tuple[int, ...]]]:
  """(name, safetensors dtype, shape) of every tensor of a checkpoint directory, by name."""
  rows = []
  for name in sorted(os.listdir(out_dir)):
    if not name.endswith(".safetensors"):
      continue
    with open(os.path.join(out_dir, name), "rb") as f:
      header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    rows += [(k, v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"]
  return sorted(rows)
