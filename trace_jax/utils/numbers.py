"""Integer helpers shared by the layers above (padding to buckets and tiles)."""


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of `multiple` (> 0) that is >= n."""
  if multiple < 1:
    raise ValueError(f"round_up: multiple={multiple} must be >= 1")
  return -(-n // multiple) * multiple
