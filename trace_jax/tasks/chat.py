"""A checkpoint's own tokenizer and chat template: the rendering layer between tasks (text) and
a pretrained policy (token ids).

Tasks keep building their prompts and observations as plain text (`Item.prompt`,
`EnvStep.observation`) and keep parsing answers out of the decoded completion; this module
only decides how that text reaches the model:

  prompt       the template renders [system?, user: prompt] with add_generation_prompt=True;
  observation  what the template writes after an assistant turn ended with its end-of-turn token
               and before the next assistant turn: the environment's text as a user (or tool)
               turn, then the generation prompt. Computed by rendering a conversation with a
               sentinel assistant message and keeping what follows the sentinel, so the template
               is used exactly as written (no hand-parsing; verl and tunix do the same delta).

The template runs in a sandboxed Jinja environment set up as Hugging Face's
`apply_chat_template` sets it up: trim_blocks, lstrip_blocks, loop controls, the globals
`raise_exception` and `strftime_now`, a `tojson` filter that keeps non-ASCII text, the
special tokens (`bos_token`, `eos_token`, ...) as variables, and the `{% generation %}` tag
(rendered as its body). A template is code from the checkpoint's author: each render runs
under a time limit and size limits (`tasks.template_sandbox`), and whatever goes wrong in
it (it does not compile, it refuses, it divides by zero, recurses, runs past its limits)
is one `ChatTemplateError` whose one-line message names the template's file. A template
file that is a symbolic link resolving outside the checkpoint directory is refused.

Files read from a checkpoint directory: tokenizer.json (the vocabulary and merges),
tokenizer_config.json (special tokens, the chat template), chat_template.jinja or
chat_template.json (newer transformers save the template there), generation_config.json
(the stop tokens: `eos_token_id`, one id or a list).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

from trace_jax.tasks.base import prompt_text as base_prompt_text
from trace_jax.tasks.tokenizer import HFTokenizer
from trace_jax.utils.io import read_json_object

PROMPT_FORMATS = ("chat", "raw")
OBSERVATION_ROLES = ("user", "tool")
_SENTINEL = "\u2063TRACE_JAX_SENTINEL\u2063"  # text no template or task produces
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
TIME_LIMIT_S = 10.0  # seconds one render may take (a real template takes milliseconds)
MAX_CHARS = 1 << 20  # characters one render may output (or build on the way)


class ChatTemplateError(ValueError):
  """A template that does not compile, refused the conversation (its own
  `raise_exception`), failed while rendering or ran past its limits."""


class _Refusal(Exception):
  """The template's `raise_exception`."""


def _one_line(error: BaseException) -> str:
  text = " ".join(str(error).split())
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _read_json(path: str) -> dict:
  """The file's JSON object, or {} when the optional file is absent."""
  return read_json_object(path) if os.path.exists(path) else {}


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _check_inside(directory: str, path: str) -> None:
  """Refuse a file of the checkpoint that resolves (a symbolic link) outside its directory.

  A Hugging Face hub cache snapshot (`.../snapshots/<revision>/`) links each file to
  `../../blobs/<hash>`; that blob directory counts as inside."""
  root = os.path.realpath(directory)
  roots = [root]
  if os.path.basename(os.path.dirname(root)) == "snapshots":
    roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
  real = os.path.realpath(path)
  if not any(os.path.commonpath([real, r]) == r for r in roots):
    raise ChatTemplateError(
      f"{path} is a symbolic link to {real}, outside the checkpoint directory {root}; "
      "copy the file into the directory"
    )


def find_chat_template(directory: str) -> tuple[str, str] | None:
  """The checkpoint's chat template as (the file holding it, its source), or None:
  chat_template.jinja, chat_template.json, then tokenizer_config.json's `chat_template` (a
  string, or a list of named templates, whose "default" is used)."""
  for name in TEMPLATE_FILES:
    path = os.path.join(directory, name)
    if os.path.lexists(path):
      _check_inside(directory, path)
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if os.path.exists(jinja_path):
    with open(jinja_path) as f:
      return jinja_path, f.read()
  for name in ("chat_template.json", "tokenizer_config.json"):
    path = os.path.join(directory, name)
    template = _read_json(path).get("chat_template")
    if isinstance(template, list):
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      if "default" not in named:
        raise ValueError(
          f"{path}: chat_template lists templates {sorted(named)} but no 'default' one"
        )
      template = named["default"]
    if template is not None:
      if not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be a string, got {type(template).__name__}")
      return path, template
  return None


def read_chat_template(directory: str) -> str | None:
  """The checkpoint's chat template's source, or None (`find_chat_template`)."""
  found = find_chat_template(directory)
  return None if found is None else found[1]


class ChatTemplate:
  """A chat template compiled as Hugging Face compiles it (see the module docstring).

  Args:
    source: the template's Jinja source.
    special_tokens: variables the template reads (`bos_token`, `eos_token`, ...).
    name: where the template comes from (its file), named by every error.
    time_limit_s: the wall-clock seconds one render may take.
    max_chars: the characters one render may output (or build on the way).
  """

  def __init__(
    self,
    source: str,
    special_tokens: dict[str, str] | None = None,
    *,
    name: str = "the chat template",
    time_limit_s: float = TIME_LIMIT_S,
    max_chars: int = MAX_CHARS,
  ):
    try:
      import jinja2
      from jinja2 import nodes
      from jinja2.ext import Extension

      from trace_jax.tasks.template_sandbox import LimitedSandbox, TemplateLimitError
    except ImportError as e:  # an optional dependency
      raise ImportError("chat templates need the `jinja2` package: pip install jinja2") from e

    class GenerationTag(Extension):
      """`{% generation %}...{% endgeneration %}` marks assistant text for masks; renders its body."""

      tags = {"generation"}

      def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
      raise _Refusal(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
      )

    self.name, self.source = name, source
    self.special_tokens = dict(special_tokens or {})
    self._limit_error = TemplateLimitError
    env = LimitedSandbox(
      time_limit_s=time_limit_s,
      max_chars=max_chars,
      trim_blocks=True,
      lstrip_blocks=True,
      extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    self._env = env
    try:
      self._template = env.compile_checked(source)
    except jinja2.TemplateError as e:
      raise ChatTemplateError(f"{name}: the chat template does not compile: {_one_line(e)}") from e
    except Exception as e:  # noqa: BLE001 - a hostile template may raise anything
      raise ChatTemplateError(f"{name}: the chat template does not compile ({_one_line(e)})") from e

  def render(
    self, messages: Sequence[dict], *, add_generation_prompt: bool = False, **options: Any
  ) -> str:
    """The template's text for `messages` ({"role", "content"} dicts).

    Args:
      messages: the conversation.
      add_generation_prompt: end with the opening of an assistant turn.
      **options: template variables (e.g. enable_thinking=False for Qwen3).

    Raises:
      ChatTemplateError: the template refused, failed or ran past its limits (one line that
        names the template's file).
    """
    variables = {**self.special_tokens, "tools": None, "documents": None, **options}
    variables.update(messages=list(messages), add_generation_prompt=add_generation_prompt)
    try:
      return self._env.render_checked(self._template, variables)
    except _Refusal as e:
      message = " ".join(str(e).split())
      raise ChatTemplateError(
        f"{self.name}: the chat template refused the conversation: {message}"
      ) from e
    except self._limit_error as e:
      raise ChatTemplateError(f"{self.name}: the chat template was stopped: {e}") from e
    except Exception as e:  # noqa: BLE001 - a hostile template may raise anything
      raise ChatTemplateError(
        f"{self.name}: the chat template failed to render ({_one_line(e)})"
      ) from e


class CheckpointTokenizer:
  """The tokenizer of a checkpoint directory, with its special tokens, stop tokens and the
  prompt format: "chat" (its chat template) or "raw" (bos, if it has one, then the text).

  Attributes:
    vocab_size: one past the largest id of tokenizer.json (added tokens included).
    bos_id, pad_id: from tokenizer_config.json (generation_config.json for pad); the end of
      turn when absent.
    eos_id: the token that ends an assistant turn (what SFT demonstrations end with): the one
      the chat template writes after an assistant message, else tokenizer_config's eos_token.
    stop_ids: what ends a rollout turn: generation_config.json's eos_token_id(s) and eos_id.
  """

  def __init__(
    self,
    directory: str,
    *,
    prompt_format: str = "chat",
    system_prompt: str = "",
    observation_role: str = "user",
    template_options: dict | None = None,
  ):
    directory = os.path.abspath(directory)
    if prompt_format not in PROMPT_FORMATS:
      raise ValueError(
        f"prompt_format={prompt_format!r} is not allowed; use one of {PROMPT_FORMATS}"
      )
    if observation_role not in OBSERVATION_ROLES:
      raise ValueError(
        f"observation_role={observation_role!r} is not allowed; use one of {OBSERVATION_ROLES}"
      )
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
      raise ValueError(
        f"{directory} has no tokenizer.json (the checkpoint's tokenizer is needed; "
        "copy it from the model's repository)"
      )
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = _read_json(config_path)
    generation = _read_json(os.path.join(directory, "generation_config.json"))
    names = {
      key: _token_text(config.get(key))
      for key in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    try:
      self._hf = HFTokenizer(
        path, bos=names["bos_token"], eos=names["eos_token"], pad=names["pad_token"]
      )
    except ValueError as e:
      raise ValueError(f"{e} (special tokens named in {config_path})") from e
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own types
      raise ValueError(f"{path} does not load as a tokenizer ({type(e).__name__}: {e})") from e
    vocab = self._hf._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1
    self.directory, self.prompt_format = directory, prompt_format
    self.system_prompt, self.observation_role = system_prompt, observation_role
    self.template_options = dict(template_options or {})
    self.has_bos = names["bos_token"] is not None or generation.get("bos_token_id") is not None
    if names["bos_token"] is None and generation.get("bos_token_id") is not None:
      self._hf.bos_id = self._check_id(generation["bos_token_id"], "bos_token_id")
    if names["pad_token"] is None and generation.get("pad_token_id") is not None:
      self._hf.pad_id = self._check_id(generation["pad_token_id"], "pad_token_id")
    self.bos_id, self.pad_id, self.eos_id = self._hf.bos_id, self._hf.pad_id, self._hf.eos_id

    found = find_chat_template(directory)
    self.template = None
    if prompt_format == "chat":
      if found is None:
        raise ValueError(
          f"{directory} has no chat template (tokenizer_config.json "
          "'chat_template', chat_template.jinja or chat_template.json); a base "
          "model takes --prompt_format=raw"
        )
      self.template = ChatTemplate(
        found[1], {k: v for k, v in names.items() if v is not None}, name=found[0]
      )
      end = self._end_of_turn()
      if end is not None:
        self.eos_id = end
    elif system_prompt:
      raise ValueError("system_prompt needs prompt_format='chat' (a raw prompt has no system turn)")
    stops = generation.get("eos_token_id")
    stops = [] if stops is None else stops if isinstance(stops, list) else [stops]
    self.stop_ids = tuple(
      dict.fromkeys([self.eos_id] + [self._check_id(s, "eos_token_id") for s in stops])
    )

  def _check_id(self, value, field: str) -> int:
    if not isinstance(value, int) or not 0 <= value < self.vocab_size:
      raise ValueError(
        f"{self.directory}/generation_config.json: {field}={value!r} is not an id "
        f"of tokenizer.json (0 to {self.vocab_size - 1})"
      )
    return value

  # --- text <-> ids ---------------------------------------------------------------------------

  def encode(self, text: str, errors: str = "strict") -> list[int]:
    """Ids of `text`; special tokens written in it (e.g. by the template) become their ids."""
    return self._hf.encode(text, errors)

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids` without special tokens; ids past the tokenizer (padded embedding rows
    of the checkpoint, which no text maps to) are dropped."""
    return self._hf.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

  # --- the rendering layer --------------------------------------------------------------------

  def _messages(self, prompt) -> list[dict]:
    """[system?, user: prompt]; a conversation (a sequence of {role, content} messages) as it
    is, after the system prompt unless it has a system message of its own."""
    system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    if not isinstance(prompt, str):
      messages = [dict(message) for message in prompt]
      if any(message.get("role") == "system" for message in messages):
        return messages
      return system + messages
    return system + [{"role": "user", "content": prompt}]

  def prompt_text(self, prompt) -> str:
    """What the policy reads first: the rendered conversation up to the assistant's turn (a
    raw prompt: the text, a conversation's contents joined)."""
    if self.template is None:
      return base_prompt_text(prompt)
    return self.template.render(
      self._messages(prompt), add_generation_prompt=True, **self.template_options
    )

  def prompt_ids(self, prompt) -> list[int]:
    if self.template is None:
      return ([self.bos_id] if self.has_bos else []) + self.encode(base_prompt_text(prompt))
    return self.encode(self.prompt_text(prompt))

  def _render_observation(self, observation: str) -> str:
    """The template's text after an assistant message, up to the next assistant turn."""
    messages = self._messages("q") + [
      {"role": "assistant", "content": _SENTINEL},
      {"role": self.observation_role, "content": observation},
    ]
    text = self.template.render(messages, add_generation_prompt=True, **self.template_options)
    if text.count(_SENTINEL) != 1:
      raise ChatTemplateError(
        f"{self.template.name}: the chat template does not write an assistant message's content "
        "exactly once; cannot place observations after a turn"
      )
    return text.split(_SENTINEL, 1)[1]

  def _end_of_turn(self) -> int | None:
    """The special token the template writes right after an assistant message, if any."""
    try:
      after = self._render_observation("x")
    except ChatTemplateError:  # a template without assistant turns: single-turn prompts only
      return None
    special = [
      (added.content, tid)
      for tid, added in self._hf._tok.get_added_tokens_decoder().items()
      if added.special
    ]
    for token, tid in sorted(special, key=lambda kv: -len(kv[0])):  # the longest match
      if after.startswith(token):
        return tid
    return None

  def observation_text(self, observation: str, turn_closed: bool = True) -> str:
    """Text between the end of an assistant turn and the next one, holding `observation` as
    a user (or tool) turn. When the policy already emitted the end-of-turn token
    (`turn_closed`), it is not written again."""
    text = self._render_observation(observation)
    end = self._hf._tok.id_to_token(self.eos_id)
    if turn_closed and end is not None and text.startswith(end):
      text = text[len(end) :]
    return text

  def observation_ids(self, observation: str, turn_closed: bool = True) -> list[int]:
    if self.template is None:
      return self.encode(observation)
    return self.encode(self.observation_text(observation, turn_closed))
