"""run.policy_source.check_fits: an episode past the model's positions is refused naming its
cause (the prompt bucket, the chat template, a long prompt's file and row, or max_new_tokens)."""

import json
import os
import shutil

import pytest

from trace_jax.model.config import get_preset
from trace_jax.rl.config import RLConfig
from trace_jax.run import policy_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_moe")
LIMIT = get_preset("tiny").max_seq_len  # 256 positions, a character tokenizer


def _dataset(tmp_path, long_question: str, row: int = 7) -> str:
  rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(10)]
  rows[row - 1] = {"question": long_question, "answer": "#### 3"}
  path = tmp_path / "problems.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _refusal(**flat) -> str:
  config = RLConfig.from_flat(**flat)
  with pytest.raises(ValueError) as caught:
    policy_source.check_fits(config, policy_source.preflight(config))
  return str(caught.value)


def test_a_prompt_longer_than_the_model_names_its_row(tmp_path):
  path = _dataset(tmp_path, "x" * 4_000)
  message = _refusal(preset="tiny", task=f"dataset:{path}")
  assert message.startswith(f"the longest prompt, {path}: line 7, is 4001 tokens")
  assert message.endswith("shorten or drop that prompt")
  assert "max_new_tokens" not in message.split(";")[-1]


def test_a_prompt_that_leaves_too_little_room_names_both_ways_out(tmp_path):
  path = _dataset(tmp_path, "y" * 199, row=3)  # 200 tokens with <bos>: 208 positions
  message = _refusal(preset="tiny", task=f"dataset:{path}", max_new_tokens=100)
  assert message.startswith(f"the longest prompt, {path}: line 3, is 200 tokens")
  assert message.endswith("shorten or drop that prompt, or lower max_new_tokens to at most 48")


def test_an_absurd_prompt_bucket_is_named(tmp_path):
  path = _dataset(tmp_path, "What is 1+1?")
  message = _refusal(preset="tiny", task=f"dataset:{path}", prompt_bucket=10**9)
  assert message.startswith("RLConfig.prompt_bucket=1000000000 pads each prompt to a multiple")
  assert "max_new_tokens" not in message
  message = _refusal(preset="tiny", task="search", prompt_bucket=10**9)
  assert "leave prompt_bucket at 0 (8 positions)" in message


def test_max_new_tokens_names_the_most_that_fits():
  message = _refusal(preset="tiny", task="arith", max_new_tokens=LIMIT)
  assert message.startswith(f"RLConfig.max_new_tokens={LIMIT}: an episode of task 'arith'")
  assert message.endswith("lower max_new_tokens to at most 240")  # + a 16-position prompt
  message = _refusal(preset="tiny", task="search", max_new_tokens=100)
  assert message.endswith("lower max_new_tokens to at most 22")  # 8 turns of 22 + 8


def test_a_chat_template_that_renders_long_is_named(tmp_path):
  checkpoint = tmp_path / "checkpoint"
  shutil.copytree(HF, checkpoint, ignore=shutil.ignore_patterns("expected.npz"))
  config = json.loads((checkpoint / "config.json").read_text())
  config["max_position_embeddings"] = 512
  (checkpoint / "config.json").write_text(json.dumps(config))
  tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
  tokenizer_config["chat_template"] = (
    "{% for i in range(300) %}{{ i }} {% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
  )
  (checkpoint / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
  message = _refusal(task="arith", hf_checkpoint=str(checkpoint), max_new_tokens=16)
  assert message.startswith(f"the chat template ({checkpoint}/tokenizer_config.json, with ")
  assert "use another template or --prompt_format=raw" in message
