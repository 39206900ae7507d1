"""experiments/rl.py as a person meets it: its help, and what it prints."""

import pytest

from tests.scripts import load_script
from trace_jax.model.config import PRESETS
from trace_jax.rl.arms import ARMS


def test_help_lists_the_run_flags_by_section_and_exits_0(capsys):
  rl, _ = load_script("rl")
  with pytest.raises(SystemExit) as exit_:
    rl.parse_flags(["rl.py", "--steps=3", "--help"])
  assert exit_.value.code == 0
  text = capsys.readouterr().out
  for section in ("source", "task", "arm", "sampling", "schedule", "evaluation", "scale-out"):
    assert f"\n{section}:" in text, section
  words = " ".join(text.split())  # as wrapped
  assert "dataset:PATH" in words and "rg:NAME" in words
  assert "(default: small; one of: " + ", ".join(PRESETS) + ")" in words
  for name, arm in ARMS.items():  # every arm, with what it does
    assert f" {name} ({arm.describe()})" in words, name
  assert "\n  --steps: RL steps.\n      (default: 150; an integer)" in text
  assert "--lr_decay" in text and "one of: constant, cosine, linear" in text
  assert "--workdir" in text and "--coordinator_address" in text  # the script's own flags
