"""A checkpoint's tokenizer and chat template (trace_jax/tasks/chat.py)."""

import importlib.util
import json
import os
import random
import re
import shutil

import pytest

from trace_jax.tasks.chat import (
  ChatTemplate,
  ChatTemplateError,
  CheckpointTokenizer,
  read_chat_template,
)

HF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
_spec = importlib.util.spec_from_file_location(
  "make_tokenizer", os.path.join(HF, "make_tokenizer.py")
)
make_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tokenizer)

# A Llama-2-like template, written here: bos_token as a variable, the system turn folded into
# the first user turn, raise_exception on a bad order, loop controls, trim_blocks/lstrip_blocks
# (the block lines leave no newlines or indentation behind), tojson and a generation tag.
LLAMA_LIKE = """
{%- if messages[0]['role'] == 'system' %}
  {%- set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}
  {%- set messages = messages[1:] %}
{%- else %}
  {%- set system = '' %}
{%- endif %}
{% for message in messages %}
  {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
    {{ raise_exception('roles must alternate user/assistant/user/...') }}
  {% endif %}
  {% if loop.index0 > 5 %}{% break %}{% endif %}
  {% if message['role'] == 'user' %}
{{ bos_token + '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}
  {% else %}
{% generation %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endgeneration %}
  {% endif %}
{% endfor %}
{% if meta is defined %}{{ meta | tojson }}{% endif %}
"""


def test_template_renders_the_hand_written_string():
  template = ChatTemplate(LLAMA_LIKE, {"bos_token": "<s>", "eos_token": "</s>"})
  messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
  ]
  # (also what transformers 5.24's render_jinja_template gives: an expression line keeps its
  # newline, a block tag's is trimmed)
  assert template.render(messages) == (
    "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n2+2? [/INST]\n 4 </s><s>[INST] and 3+3? [/INST]\n"
  )
  # tojson keeps non-ASCII text as is (as Hugging Face's filter does)
  assert template.render(messages[1:2], meta={"name": "café"}) == (
    '<s>[INST] 2+2? [/INST]\n{"name": "café"}'
  )
  with pytest.raises(ChatTemplateError, match="roles must alternate"):
    template.render([{"role": "assistant", "content": "x"}])
  with pytest.raises(ChatTemplateError, match="does not compile"):
    ChatTemplate("{% for m in messages %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A directory with the procedural tokenizer (96 ids) and the ChatML template."""
  path = tmp_path_factory.mktemp("ckpt")
  make_tokenizer.write(str(path), 96)
  return str(path)


def test_prompt_and_observations_render_as_written(checkpoint):
  tok = CheckpointTokenizer(checkpoint, system_prompt="answer after #.")
  assert tok.prompt_text("7+8=") == (
    "<|im_start|>system\nanswer after #.<|im_end|>\n"
    "<|im_start|>user\n7+8=<|im_end|>\n<|im_start|>assistant\n"
  )
  # the policy closed its turn with <|im_end|> (a stop token): what follows it
  assert tok.observation_text("<") == "\n<|im_start|>user\n<<|im_end|>\n<|im_start|>assistant\n"
  # stopped by length: the template's end of turn is written first
  assert tok.observation_text("<", turn_closed=False) == (
    "<|im_end|>\n<|im_start|>user\n<<|im_end|>\n<|im_start|>assistant\n"
  )
  tool = CheckpointTokenizer(checkpoint, observation_role="tool")
  assert tool.prompt_text("find n in 0-7") == (
    "<|im_start|>user\nfind n in 0-7<|im_end|>\n<|im_start|>assistant\n"
  )
  assert tool.observation_text(">") == (
    "\n<|im_start|>user\n<tool_response>\n>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
  )
  # special ids from tokenizer_config.json / generation_config.json, not guessed
  ids = {t: tok._hf._tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")}
  assert tok.eos_id == ids["<|im_end|>"] and tok.pad_id == ids["<|endoftext|>"]
  assert tok.stop_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
  assert tok.vocab_size == 96
  # special tokens written by the template encode as single ids
  prompt = tok.prompt_ids("7+8=")
  assert prompt[0] == ids["<|im_start|>"] and prompt.count(ids["<|im_end|>"]) == 2
  assert tok.decode(prompt) == "system\nanswer after #.\nuser\n7+8=\nassistant\n"


def test_encode_decode_round_trip_on_random_text(checkpoint):
  tok = CheckpointTokenizer(checkpoint)
  rng = random.Random(113)
  for _ in range(50):
    text = "".join(rng.choice(make_tokenizer.ALPHABET) for _ in range(rng.randint(1, 40)))
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
  # ids past the tokenizer (padded embedding rows) decode to nothing rather than failing
  assert tok.decode(tok.encode("12") + [tok.vocab_size, 10**6]) == "12"


def test_the_committed_fixture_matches_transformers():
  """Ids of transformers 5.24's apply_chat_template(tokenize=True) on tests/fixtures/hf/
  qwen3_moe (recorded with /work/venv-hf), for a prompt and a tool observation."""
  tok = CheckpointTokenizer(
    os.path.join(HF, "qwen3_moe"), system_prompt="answer after #.", observation_role="tool"
  )
  prompt = [
    1,
    90,
    61,
    87,
    62,
    59,
    95,
    84,
    93,
    80,
    2,
    4,
    1,
    94,
    4,
    22,
    10,
    23,
    28,
    2,
    4,
    1,
    32,
    89,
    88,
    85,
    92,
  ]
  assert tok.prompt_ids("7+8=") == prompt
  # + assistant "Z" (unknown: <unk> 3) + <|im_end|> + the tool turn and generation prompt
  assert prompt + [3, 2] + tok.observation_ids("<") == prompt + [
    3,
    2,
    4,
    1,
    94,
    60,
    76,
    60,
    60,
    81,
    2,
    4,
    1,
    32,
    89,
    88,
    85,
    92,
  ]


def test_template_sources(tmp_path, checkpoint):
  path = str(tmp_path)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(checkpoint, name), path)
  config_path = os.path.join(path, "tokenizer_config.json")
  config = json.load(open(config_path))
  # a list of named templates: the "default" one
  config["chat_template"] = [
    {"name": "tool_use", "template": "T"},
    {"name": "default", "template": "D"},
  ]
  json.dump(config, open(config_path, "w"))
  assert read_chat_template(path) == "D"
  # chat_template.jinja (how newer transformers save it) comes first
  open(os.path.join(path, "chat_template.jinja"), "w").write("J{{ messages[0].content }}")
  assert read_chat_template(path) == "J{{ messages[0].content }}"
  single = CheckpointTokenizer(path)
  assert single.prompt_text("12") == "J12"
  # a template that never writes assistant turns serves single-turn prompts only
  with pytest.raises(ChatTemplateError, match="exactly once"):
    single.observation_ids("<")
  config["chat_template"] = [{"name": "tool_use", "template": "T"}]
  json.dump(config, open(config_path, "w"))
  os.remove(os.path.join(path, "chat_template.jinja"))
  with pytest.raises(ValueError, match="no 'default'"):
    read_chat_template(path)


def test_bad_checkpoint_directories(tmp_path, checkpoint):
  path = str(tmp_path)
  with pytest.raises(ValueError, match="has no tokenizer.json"):
    CheckpointTokenizer(path)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(checkpoint, name), path)
  config_path = os.path.join(path, "tokenizer_config.json")
  config = json.load(open(config_path))
  with pytest.raises(ValueError, match="prompt_format="):
    CheckpointTokenizer(path, prompt_format="jinja")
  with pytest.raises(ValueError, match="observation_role="):
    CheckpointTokenizer(path, observation_role="environment")
  with pytest.raises(ValueError, match="system_prompt needs prompt_format='chat'"):
    CheckpointTokenizer(path, prompt_format="raw", system_prompt="hi")
  # a raw prompt needs no template; a chat prompt does
  del config["chat_template"]
  json.dump(config, open(config_path, "w"))
  raw = CheckpointTokenizer(path, prompt_format="raw")
  assert raw.prompt_ids("12") == raw.encode("12")  # no bos_token: nothing prepended
  with pytest.raises(ValueError, match="no chat template.*--prompt_format=raw"):
    CheckpointTokenizer(path)
  # special tokens named in tokenizer_config.json must exist
  json.dump({**config, "eos_token": "<|eot|>"}, open(config_path, "w"))
  with pytest.raises(ValueError, match="no token '<|eot|>'"):
    CheckpointTokenizer(path, prompt_format="raw")
  json.dump(config, open(config_path, "w"))
  # stop ids must be ids of the tokenizer
  json.dump({"eos_token_id": [2, 500]}, open(os.path.join(path, "generation_config.json"), "w"))
  with pytest.raises(ValueError, match="eos_token_id=500"):
    CheckpointTokenizer(path, prompt_format="raw")
  open(config_path, "w").write("{not json")
  with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
    CheckpointTokenizer(path, prompt_format="raw")
  json.dump(config, open(config_path, "w"))
  open(os.path.join(path, "tokenizer.json"), "w").write("{}")
  with pytest.raises(ValueError, match="does not load as a tokenizer"):
    CheckpointTokenizer(path, prompt_format="raw")


def test_template_files_linking_outside_the_checkpoint_are_refused(tmp_path, checkpoint):
  path = tmp_path / "ckpt"
  path.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(checkpoint, name), path)
  outside = tmp_path / "elsewhere.jinja"
  outside.write_text("O{{ messages[0].content }}")
  link = path / "chat_template.jinja"
  link.symlink_to(outside)
  with pytest.raises(
    ChatTemplateError,
    match=f"^{re.escape(str(link))} is a symbolic link to {re.escape(str(outside))}, outside",
  ):
    CheckpointTokenizer(str(path))
  link.unlink()
  (path / "templates").mkdir()
  (path / "templates" / "t.jinja").write_text("I{{ messages[0].content }}")
  link.symlink_to(path / "templates" / "t.jinja")  # a link inside the directory is followed
  assert CheckpointTokenizer(str(path)).prompt_text("12") == "I12"
  # tokenizer_config.json (which holds the template) linked outside
  link.unlink()
  config = path / "tokenizer_config.json"
  os.replace(config, tmp_path / "tokenizer_config.json")
  config.symlink_to(tmp_path / "tokenizer_config.json")
  with pytest.raises(ChatTemplateError, match=f"^{re.escape(str(config))} is a symbolic link"):
    CheckpointTokenizer(str(path))
  # a Hugging Face hub cache snapshot links every file to ../../blobs: inside
  snapshot = tmp_path / "models--x--y" / "snapshots" / "abc"
  blobs = tmp_path / "models--x--y" / "blobs"
  snapshot.mkdir(parents=True)
  blobs.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(checkpoint, name), blobs / f"hash-{name}")
    (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", f"hash-{name}"))
  assert CheckpointTokenizer(str(snapshot)).prompt_text("7") == CheckpointTokenizer(
    checkpoint
  ).prompt_text("7")
