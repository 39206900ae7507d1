"""Small shared helpers with no model or format knowledge: timing, tables."""

from trace_jax.utils.timing import markdown_table, time_jitted
