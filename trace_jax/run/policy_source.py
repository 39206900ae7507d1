"""Where an RL run's policy and tokenizer come from (`RLConfig.source`):

- a built-in preset: random initial weights, the built-in character tokenizer, raw prompts,
  and an SFT warm start on solver demonstrations (a random policy never earns a reward);
- a local Hugging Face checkpoint directory: the weights through `from_hf`, the checkpoint's
  own tokenizer (tokenizer.json), special and stop tokens (tokenizer_config.json,
  generation_config.json) and chat template (`tasks.chat`); no warm start unless asked for
  (`--sft_warm_start`), since a pretrained policy already answers.

Vocabulary and special ids always come from the tokenizer, never from a preset, and the one
tokenizer built here serves the rollouts, the reference policy, the warm start and the
evaluation alike. Everything that can be wrong with a checkpoint directory (missing files, a
tokenizer larger than the embedding, a template that is absent, refuses the task's
conversation, fails or runs past its limits) is a ValueError raised by `check` before any
weight is read (and, by the Trainer, before the run's workdir is made).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
from flax import nnx

from trace_jax import fp4, memory_bound
from trace_jax.model.config import PRESETS, ModelConfig, get_preset
from trace_jax.model.hf import checkpoint_file, from_hf, read_config, shard_files
from trace_jax.model.transformer import Transformer
from trace_jax.rl import data as rl_data
from trace_jax.rl import episodes
from trace_jax.run import async_rollouts
from trace_jax.tasks.base import Task, prompt_text
from trace_jax.tasks.chat import CheckpointTokenizer
from trace_jax.tasks.registry import get_task
from trace_jax.tasks.tokenizer import CharTokenizer, Tokenizer

# Observation tokens a turn may add in the raw format (today's budget: <obs>, text, </obs>);
# a chat template adds its own scaffolding on top of this much text.
OBSERVATION_TOKENS = 8


@dataclasses.dataclass
class PolicySource:
  """The initial policy and everything that must agree with it.

  Attributes:
    tokenizer: text <-> ids for rollouts, reference, warm start and evaluation.
    model_cfg: the policy's architecture (vocab_size from the checkpoint or the preset).
    policy: the initial weights (before any warm start).
    pretrained: loaded from a checkpoint (True) or randomly initialised (False).
    stop_tokens: ids that end a rollout turn.
    observation_len: tokens one observation may take between two turns (cache budget).
  """

  tokenizer: Tokenizer
  model_cfg: ModelConfig
  policy: Transformer
  pretrained: bool
  stop_tokens: tuple[int, ...]
  observation_len: int


def preflight(config) -> Task:
  """The run's task, and the checks of a config that need the task or the disk, before any
  work: the task's options (names and values), the checkpoint directory's files, and the
  policy's widths against the FP4 blocks (`architecture`), and RLConfig.rollout_devices
  against the job's devices (`async_rollouts.device_groups`)."""
  async_rollouts.device_groups(config)
  task = get_task(config.task, **dict(config.task_options))
  if config.source.sft_warm_start and not task.has_demonstrations:
    raise ValueError(
      f"RLConfig.sft_warm_start=True: task {config.task!r} has no demonstrations to train "
      "on (a dataset file needs a response or solution column); leave sft_warm_start unset"
    )
  architecture(config)  # the checkpoint's files; the widths against the FP4 blocks
  return task


def prompt_format(config) -> str:
  """ "chat" or "raw": `RLConfig.source.prompt_format`, "auto" = chat for a checkpoint."""
  return "chat" if config.source.chat else "raw"


def warm_start(config, task: Task | None = None) -> bool:
  """Whether the run makes (or reloads) an SFT warm start: `RLConfig.source.sft_warm_start`, by
  default yes for a preset and no for a pretrained checkpoint, and never for a task without
  demonstrations (`Task.has_demonstrations`: `preflight` refuses one forced on it)."""
  if task is not None and not task.has_demonstrations:
    return False
  if config.source.sft_warm_start is not None:
    return bool(config.source.sft_warm_start)
  return not config.source.hf_checkpoint


# The files of a checkpoint directory that the policy source reads, beside the weights.
_READ_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def check_checkpoint_files(directory: str) -> str:
  """The absolute directory, or a ValueError naming what is missing (config.json, weights,
  tokenizer.json) or what resolves outside the directory."""
  path = os.path.abspath(directory)
  if not os.path.isdir(path):
    raise ValueError(f"hf_checkpoint={directory!r} is not a directory")
  missing = [
    name
    for name in ("config.json", "tokenizer.json")
    if not os.path.exists(os.path.join(path, name))
  ]
  if not any(
    name.endswith((".safetensors", ".safetensors.index.json")) for name in os.listdir(path)
  ):
    missing.append("*.safetensors")
  if missing:
    raise ValueError(
      f"hf_checkpoint={directory!r} lacks {', '.join(missing)} (a checkpoint "
      "directory holds config.json, *.safetensors, tokenizer.json, "
      "tokenizer_config.json and generation_config.json)"
    )
  for name in _READ_FILES:  # none may resolve outside the directory (a symlink out, say)
    if os.path.lexists(os.path.join(path, name)):
      checkpoint_file(path, name)
  shard_files(path)  # the index and each shard it names, the same way
  return path


def _checkpoint_config(path: str) -> ModelConfig:
  return read_config(os.path.join(path, "config.json"))[0]


def architecture(config) -> ModelConfig:
  """The policy's architecture as its source states it: the preset, or the checkpoint's
  config.json (its files checked; no weight read), whose widths fit the run's FP4 blocks."""
  if config.source.hf_checkpoint:
    model_cfg = _checkpoint_config(check_checkpoint_files(config.source.hf_checkpoint))
  else:
    model_cfg = get_preset(config.source.preset)
  _check_block_fit(config, model_cfg)
  return model_cfg


def check(config, task: Task) -> tuple[Tokenizer, ModelConfig]:
  """The tokenizer and the architecture of a run, every input checked; reads no weights."""
  model_cfg = architecture(config)
  if not config.source.hf_checkpoint:
    tokenizer = CharTokenizer()
    return tokenizer, model_cfg.replace(vocab_size=max(model_cfg.vocab_size, tokenizer.vocab_size))
  path = os.path.abspath(config.source.hf_checkpoint)
  tokenizer = CheckpointTokenizer(
    path,
    prompt_format=prompt_format(config),
    system_prompt=config.source.system_prompt,
    observation_role=config.source.observation_role,
    template_options=dict(config.source.chat_template_options),
  )
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(
      f"{path}: tokenizer.json has ids up to {tokenizer.vocab_size - 1} but the "
      f"checkpoint's embedding has {model_cfg.vocab_size} rows (config.json "
      "vocab_size): the tokenizer belongs to another model"
    )
  # The task's conversation must render (a template may refuse a role) before any work.
  tokenizer.prompt_ids(task.sample(0, 1)[0].prompt)
  if task.multi_turn:
    tokenizer.observation_ids("?", turn_closed=False)
  return tokenizer, model_cfg


def _check_block_fit(config, model_cfg: ModelConfig) -> None:
  """A ValueError before any weight is read if the policy's widths (`model_cfg`, the
  preset's or the checkpoint's: whichever the run uses) do not split into the run's FP4
  blocks in its FP4 scope (the rollout's FP4 weights and KV cache, the QAT path and the FP4
  evaluation all need whole blocks); it names the widths and what would fit."""
  fmt, sites = config.fp4.fmt, config.fp4.sites

  def misfits(cfg: ModelConfig, fmt: str, sites: str) -> dict[str, int]:
    block = fp4.get_format(fmt).block_size
    return {f: w for f, w in cfg.quantized_widths(sites).items() if w % block}

  wrong = misfits(model_cfg, fmt, sites)
  if not wrong:
    return
  block = fp4.get_format(fmt).block_size
  if config.source.hf_checkpoint:
    source = f"hf_checkpoint={config.source.hf_checkpoint!r}: the checkpoint"
  else:
    source = f"preset={config.source.preset!r}"
  hints = []
  if sites == "all" and not misfits(model_cfg, fmt, "experts+kv"):
    hints.append("RLConfig.fp4_sites='experts+kv' (the method's scope) fits it")
  if fmt != "nvfp4" and not misfits(model_cfg, "nvfp4", sites):
    hints.append("fmt='nvfp4' fits it")
  if not config.source.hf_checkpoint:
    fits = [name for name in PRESETS if not misfits(get_preset(name), fmt, sites)]
    hints.append(f"presets that fit: {fits}")
  raise ValueError(
    f"RLConfig.fmt={fmt!r} quantizes in blocks of {block}, but {source} has "
    f"{', '.join(f'{f}={w}' for f, w in wrong.items())} (FP4 scope fp4_sites={sites!r}), "
    f"not a multiple of {block}" + "".join(f"; {hint}" for hint in hints)
  )


def runtime_fields(config) -> dict:
  """The ModelConfig fields an RLConfig sets on any architecture: how the policy computes
  (per-layer remat, layers under a scan), not what it is."""
  return {"remat": config.source.remat, "scan_layers": config.source.scan_layers}


def load_hf_policy(path: str, mesh=None, **overrides) -> Transformer:
  """The policy of the Hugging Face checkpoint directory `path` (`model.from_hf`), the one
  place a run reads one. With `mesh` (the learner's), `from_hf` builds every parameter in
  its final sharding on that mesh, so no device or host holds the whole model; without, it
  loads onto one device and the caller places it (`sharding.shard_model`) if it runs on a
  mesh after all. `overrides`: ModelConfig fields of the run (`runtime_fields`)."""
  if mesh is None:
    return from_hf(path, **overrides)
  return from_hf(path, mesh=mesh, **overrides)


def load(
  config,
  task: Task,
  *,
  weights: bool = True,
  checked: tuple[Tokenizer, ModelConfig] | None = None,
  mesh=None,
) -> PolicySource:
  """The run's tokenizer and initial policy (see the module docstring), configured for the
  run (`runtime_fields`): the policy's cfg is final here, nothing mutates it later.

  weights=False: the policy is abstract (shapes only, no weight read or initialised), the
  structure a checkpoint of the run restores into. checked: what `check(config, task)`
  returned, when the caller checked the run before (e.g. before making its workdir).
  mesh: the learner's mesh, which a checkpoint's policy is read onto shard by shard
  (`load_hf_policy`); a preset's policy is initialised whole and placed by the caller."""
  tokenizer, model_cfg = check(config, task) if checked is None else checked
  model_cfg = model_cfg.replace(**runtime_fields(config))
  if not weights:  # (from_hf's cfg is the same: config_from_hf + the runtime fields)
    policy = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(config.seed)))
  elif config.source.hf_checkpoint:
    policy = load_hf_policy(config.source.hf_checkpoint, mesh, **runtime_fields(config))
    model_cfg = policy.cfg
  else:
    policy = Transformer(model_cfg, rngs=nnx.Rngs(config.seed))
  stop_tokens = tuple(getattr(tokenizer, "stop_ids", (tokenizer.eos_id,)))
  return PolicySource(
    tokenizer=tokenizer,
    model_cfg=model_cfg,
    policy=policy,
    pretrained=bool(config.source.hf_checkpoint),
    stop_tokens=stop_tokens,
    observation_len=observation_len(config, tokenizer),
  )


def observation_len(config, tokenizer: Tokenizer) -> int:
  """Tokens one observation may take between two turns: the raw budget, plus a chat
  template's scaffolding around it."""
  if config.source.hf_checkpoint:
    return OBSERVATION_TOKENS + len(tokenizer.observation_ids("", turn_closed=False))
  return OBSERVATION_TOKENS


def check_fits(config, task: Task, checked: tuple[Tokenizer, ModelConfig] | None = None) -> None:
  """A ValueError before any work (no weight read, no workdir touched) if the run's episodes
  do not fit the model (`max_new_tokens` beyond `max_seq_len`) or one of its step's
  programs cannot fit a device at its batch (`memory_bound.batch_lower_bound_bytes`: the rollout's
  KV cache and attention scores, the update's logits and their gradients, against the
  device's memory). checked: what `check(config, task)` returned, if the caller has it."""
  tokenizer, model_cfg = check(config, task) if checked is None else checked
  max_len, bucket = episodes.episode_len(
    config, task, tokenizer, observation_len(config, tokenizer)
  )
  if max_len > model_cfg.max_seq_len:
    raise ValueError(_too_long(config, task, tokenizer, model_cfg.max_seq_len))
  data = config.mesh[0]
  if data == -1:  # not resolved yet (`RLConfig.on_devices`): at most the devices left
    left = jax.device_count() - config.rollout_devices
    data = max(1, left // math.prod(config.mesh[1:]))
  schedule = config.schedule
  fp4_kv = config.arm_spec.rollout_precision == "fp4" and config.fp4.kv == "fp4"
  phases = memory_bound.batch_lower_bound_bytes(
    model_cfg,
    config.batch,
    max_len,
    data=data,
    minibatch=config.batch // schedule.minibatches,
    chunk=min(config.sampling.prefill_chunk or bucket, bucket),  # the prompt holds a bucket
    kv_quant=config.fp4 if fp4_kv else None,
    fused=schedule.minibatches == 1 and schedule.epochs == 1,
  )
  memory = memory_bound.device_memory_bytes()
  phase, rows = max(phases.items(), key=lambda item: sum(item[1].values()))
  need = sum(rows.values())
  if memory is not None and need > memory:
    parts = ", ".join(f"{name} {value / 1e9:.1f} GB" for name, value in rows.items())
    raise ValueError(
      f"RLConfig.prompts_per_step={config.sampling.prompts_per_step} x group_size="
      f"{config.sampling.group_size} = {config.batch} sequences of {max_len} slots "
      f"(max_new_tokens={config.sampling.max_new_tokens}, minibatches={schedule.minibatches}) "
      f"need at least {need / 1e9:.1f} GB ({need:.0f} bytes) per device in the {phase} "
      f"({parts}; {data} data-parallel device(s)), more than a device's {memory / 1e9:.1f} GB "
      f"({memory:.0f} bytes); lower prompts_per_step or group_size, raise minibatches, or add "
      "data-parallel devices (--mesh)"
    )


def _too_long(config, task: Task, tokenizer: Tokenizer, limit: int) -> str:
  """Why the run's longest episode does not fit the model's `limit` positions, naming the
  cause: the prompt bucket, the chat template, the longest prompt (`Task.origin`: a
  dataset's file and row), or max_new_tokens."""
  new, obs = config.sampling.max_new_tokens, observation_len(config, tokenizer)
  max_len, bucket = episodes.episode_len(config, task, tokenizer, obs)
  lengths = [
    (len(rl_data.prompt_ids(tokenizer, it)), i) for i, it in enumerate(task.prompt_probe())
  ]
  prompt_len, index = max(lengths)
  item = task.prompt_probe()[index]
  default = 8 if task.multi_turn else 16  # RLConfig.prompt_bucket=0's
  if config.sampling.prompt_bucket and (
    bucket >= limit or episodes.max_len_for(task, prompt_len, new, default, obs) <= limit
  ):
    return (
      f"RLConfig.prompt_bucket={bucket} pads each prompt to a multiple of {bucket} positions: "
      f"an episode of task {config.task!r} then needs {max_len} positions, but the model "
      f"holds max_seq_len={limit}; leave prompt_bucket at 0 ({default} positions) or lower it"
    )
  turns = episodes.max_len_for(task, 0, new, bucket, obs)  # positions past the prompt
  prompt = max_len - turns
  fewer = new - -(-(max_len - limit) // task.max_turns)  # max_new_tokens that would fit
  lower = f"lower max_new_tokens to at most {fewer}" if fewer > 0 else ""
  if turns >= limit or prompt < limit // 2:
    return (
      f"RLConfig.max_new_tokens={new}: an episode of task {config.task!r} then needs "
      f"{max_len} positions (prompt {prompt} + {task.max_turns} turn(s) {turns}), but the "
      f"model holds max_seq_len={limit}; {lower or 'lower max_new_tokens'}"
    )
  text = len(tokenizer.encode(prompt_text(item.prompt), errors="replace"))
  template = getattr(getattr(tokenizer, "template", None), "name", None)
  room = f"{max(limit - turns, 0)} positions are left for a prompt beside max_new_tokens={new}"
  lower = f", or {lower}" if lower else ""
  if template and prompt_len - text > text:
    return (
      f"the chat template ({template}, with --system_prompt if given) renders "
      f"{prompt_len - text} tokens around a prompt's {text}: the longest prompt, "
      f"{task.origin(item)}, takes {prompt_len} tokens, but the model holds "
      f"max_seq_len={limit} and {room}; use another template or --prompt_format=raw{lower}"
    )
  return (
    f"the longest prompt, {task.origin(item)}, is {prompt_len} tokens: the model holds "
    f"max_seq_len={limit} and {room}; shorten or drop that prompt{lower}"
  )


def skipped_warm_start(task: Task) -> dict:
  """The warm-start record of a run that starts from its initial weights as they are: a
  pretrained checkpoint's, or any policy's on a task without demonstrations."""
  if not task.has_demonstrations:
    reason = "the task has no demonstrations (a dataset file without a response column)"
  else:
    reason = "pretrained checkpoint (--sft_warm_start to force one)"
  return {
    "task": task.name,
    "steps": 0,
    "first_nll": None,
    "final_nll": None,
    "loaded": False,
    "skipped": reason,
  }
