"""Small shared helpers with no model or format knowledge: timing, tables, files."""

from trace_jax.utils.io import append_jsonl, read_json_object, read_jsonl, write_atomic, write_json
from trace_jax.utils.numbers import round_up
from trace_jax.utils.timing import markdown_table, median_ratio, time_interleaved, time_jitted
