"""Tokenizers: a built-in character-level one, and real ones from a local tokenizer.json."""

from __future__ import annotations

import string
from typing import Protocol, Sequence

SPECIALS = ("<pad>", "<bos>", "<eos>", "<obs>", "</obs>")


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  bos_id: int
  eos_id: int

  def encode(self, text: str, errors: str = "strict") -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
  """One token per printable ASCII character (and newline), plus the special tokens RL needs:
  <pad> 0, <bos> 1, <eos> 2 (the stop token), <obs> 3 and </obs> 4 (around environment
  observations in multi-turn tasks). 101 ids: fits the `tiny` and `small` presets (128)."""

  def __init__(self):
    chars = string.digits + string.ascii_letters + string.punctuation + " \n"
    self.specials = SPECIALS
    self.chars = chars
    self._to_id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
    self.vocab_size = len(SPECIALS) + len(chars)
    self.pad_id, self.bos_id, self.eos_id, self.obs_id, self.obs_end_id = range(len(SPECIALS))

  def encode(self, text: str, errors: str = "strict") -> list[int]:
    """Ids of the characters; errors="replace" maps unknown ones to '?', "strict" raises."""
    unknown = sorted(set(c for c in text if c not in self._to_id))
    if unknown and errors == "strict":
      raise ValueError(f"CharTokenizer cannot encode characters {unknown!r}")
    return [self._to_id.get(c, self._to_id["?"]) for c in text]

  def decode(self, ids: Sequence[int]) -> str:
    """Text of the ids; special tokens are dropped, ids out of range become '?'."""
    out = []
    for i in ids:
      i = int(i)
      if i < len(SPECIALS):
        continue
      out.append(self.chars[i - len(SPECIALS)] if i < self.vocab_size else "?")
    return "".join(out)


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer loaded from a local tokenizer.json."""

  def __init__(
    self, path: str, *, bos: str | None = None, eos: str | None = None, pad: str | None = None
  ):
    try:
      from tokenizers import Tokenizer as _Tokenizer
    except ImportError as e:  # an optional dependency
      raise ImportError(
        "loading tokenizer.json needs the `tokenizers` package: pip install tokenizers"
      ) from e
    self._tok = _Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size()

    def special(name, candidates):
      if name:  # asked for by name: it must exist
        tid = self._tok.token_to_id(name)
        if tid is None:
          raise ValueError(f"{path}: no token {name!r}")
        return tid
      for token in candidates:
        tid = self._tok.token_to_id(token)
        if tid is not None:
          return tid
      return None

    self.eos_id = special(eos, ["</s>", "<|endoftext|>", "<|im_end|>", "<eos>"])
    self.bos_id = special(bos, ["<s>", "<|im_start|>", "<bos>"])
    self.pad_id = special(pad, ["<pad>", "<|endoftext|>"])
    if self.eos_id is None:
      raise ValueError(f"{path}: found no end-of-sequence token; pass eos=")
    self.bos_id = self.eos_id if self.bos_id is None else self.bos_id
    self.pad_id = self.eos_id if self.pad_id is None else self.pad_id

  def encode(self, text: str, errors: str = "strict") -> list[int]:
    del errors  # byte-level BPE encodes any text
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str | None = None, **kwargs) -> Tokenizer:
  """The built-in CharTokenizer (path None), or a local tokenizer.json."""
  return CharTokenizer() if path is None else HFTokenizer(path, **kwargs)
