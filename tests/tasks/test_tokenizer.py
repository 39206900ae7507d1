"""Tokenizers: the built-in character tokenizer and a local tokenizer.json."""

import pytest

from trace_jax.tasks import CharTokenizer, load_tokenizer


def test_char_tokenizer_round_trip_and_specials():
  tok = CharTokenizer()
  text = "12+7=19;#19 f(x)=3*x+2\nfind n in 0-63"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert min(ids) >= 5 and max(ids) < tok.vocab_size == 101
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
  with pytest.raises(ValueError, match="cannot encode"):
    tok.encode("naïve")
  assert tok.decode(tok.encode("naïve", errors="replace")) == "na?ve"


def test_tokenizer_json_loads(tmp_path):
  tokenizers = pytest.importorskip("tokenizers", reason="the hf extra is not installed")
  from tokenizers import models, pre_tokenizers

  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "find": 3, "n": 4, "in": 5, "[UNK]": 6}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  loaded = load_tokenizer(str(path))
  assert loaded.vocab_size == 7
  assert (loaded.pad_id, loaded.bos_id, loaded.eos_id) == (0, 1, 2)
  assert loaded.encode("find n in") == [3, 4, 5]
  assert loaded.decode([3, 4, 5]) == "find n in"
  with pytest.raises(ValueError, match="no token"):
    load_tokenizer(str(path), eos="<eos>")
