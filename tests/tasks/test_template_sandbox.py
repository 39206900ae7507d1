"""Chat templates under limits (trace_jax/tasks/template_sandbox.py, through tasks.chat):
hostile templates stop in time with one error naming their file; valid ones render exactly
as plain jinja2 renders them."""

import json
import os
import random

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trace_jax.tasks.chat import ChatTemplate, ChatTemplateError

HF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
NAME = "/checkpoints/evil/chat_template.jinja"
MESSAGES = [{"role": "user", "content": "7+8="}]

# Templates that each keep one render busy for minutes (or allocate without bound).
HANGING = {
  "nested ranges": (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
  ),
  "nested loops over a string": (
    "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% for c in s %}"
    "{% endfor %}{% endfor %}{% endfor %}"
  ),
  "a huge power": "{{ 9 ** (9 ** 9) }}",
  "a huge repetition": "{{ 'x' * 10 ** 12 }}",
  "a huge output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
  "doubling concatenations": (
    "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}"
  ),
  "a huge width": "{{ 'x' | center(10 ** 12) }}",
  "a huge format width": "{{ '%0999999999d' % 1 }}",
  "a huge replace": "{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}",
  "a huge join": "{% set s = 'x' * 100000 %}{{ ([s] * 100000) | join }}",
  "deep recursion of loops": (
    "{% macro f(n) %}{% for i in range(100000) %}{{ f(n) }}{% endfor %}{% endmacro %}{{ f(0) }}"
  ),
}


def _one_line_naming_the_file(error: ChatTemplateError) -> str:
  message = str(error)
  assert "\n" not in message and message.startswith(f"{NAME}: "), message
  return message


@pytest.mark.timeout(120)  # a template the sandbox failed to stop would hang here
@pytest.mark.parametrize("case", sorted(HANGING))
def test_hostile_templates_stop_in_time_with_one_error(case):
  template = ChatTemplate(HANGING[case], name=NAME, time_limit_s=0.3)
  with pytest.raises(ChatTemplateError) as raised:
    template.render(MESSAGES)
  message = _one_line_naming_the_file(raised.value)
  assert "stopped" in message or "RecursionError" in message


def test_the_time_limit_holds_in_every_render():
  # The deadline is per render: a template stopped once renders (and stops) again.
  template = ChatTemplate(
    "{% if messages | length > 1 %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}{{ messages[0].content }}",
    name=NAME,
    time_limit_s=0.2,
  )
  for _ in range(2):
    with pytest.raises(ChatTemplateError, match="time limit of 0.2 s"):
      template.render(MESSAGES * 2)
    assert template.render(MESSAGES) == "7+8="


def _raises(kind):
  def boom():
    raise kind("x\ny")  # a two-line message, written as one

  return boom


@pytest.mark.parametrize(
  "source, options, kind",
  [
    ("{{ 1 / 0 }}", {}, "ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", {}, "RecursionError"),
    ("{{ range(10 ** 6) | list }}", {}, "OverflowError"),
    ("{{ 2.0 ** 100000 }}", {}, "OverflowError"),
    ("{{ 1 + 'a' }}", {}, "TypeError"),
    ("{{ boom() }}", {"boom": _raises(MemoryError)}, "MemoryError"),
    ("{{ boom() }}", {"boom": _raises(KeyError)}, "KeyError"),
    ("{{ '{:d}'.format(messages[0].content) }}", {}, "ValueError"),
  ],
)
def test_every_failure_is_one_error_naming_the_file(source, options, kind):
  template = ChatTemplate(source, name=NAME)
  with pytest.raises(ChatTemplateError) as raised:
    template.render(MESSAGES, **options)
  message = _one_line_naming_the_file(raised.value)
  assert f"failed to render ({kind}" in message
  assert isinstance(raised.value, ValueError)  # the CLI's one-line error type


def test_compile_and_refusal_errors_name_the_file():
  with pytest.raises(ChatTemplateError, match=f"^{NAME}: the chat template does not compile"):
    ChatTemplate("{% for m in messages %}", name=NAME)
  with pytest.raises(ChatTemplateError) as raised:
    ChatTemplate("{{ raise_exception('no\nsystem turns') }}", name=NAME).render(MESSAGES)
  assert _one_line_naming_the_file(raised.value).endswith(
    "refused the conversation: no system turns"
  )


# A template using what the limits hook into: loops (loop.length, loop.last, recursive),
# calls, filters, `~`, `+`, `*`, `%`, str.format, join, replace, attributes and items.
FEATURES = """
{%- set ns = namespace(total=0, text='') -%}
{%- for m in messages -%}
{%- set ns.total = ns.total + (m.content | length) * 2 - 1 -%}
{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }} {{ m['role'] | upper }}: {{ m.content ~ '|' }}
{{ '%-6s|%3d' % (m.role, loop.index0) }} {{ '{}-{:>4}'.format(m.role, loop.revindex) }}
{{ m.content.replace('a', 'AA') | center(30) | trim }} {{ (m.content * 2) | wordwrap(12) }}
{%- set ns.text = ns.text ~ m.content[:3] -%}
{%- endfor %}
{% for x in [[1, [2, [3]]], 'leaf'] recursive %}[{{ x if x is string or x is number else loop(x) }}]{% endfor %}
{{ range(3) | map('string') | join(',') }} {{ ns.total }} {{ ns.text | tojson }} {{ 2 ** 10 }}
{{ [1, 2] + [3] }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** -1 }} {{ messages | selectattr('role',
'equalto', 'user') | list | length }}{% if add_generation_prompt %}<go>{% endif %}
"""


def _plain_render(source: str, messages, **variables) -> str:
  """The same options through plain jinja2, without the limits."""
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
  return env.from_string(source).render(messages=messages, **variables)


def test_valid_templates_render_as_plain_jinja2_renders_them():
  with open(os.path.join(HF, "qwen3_moe", "tokenizer_config.json")) as f:
    qwen = json.load(f)["chat_template"]
  rng = random.Random(1311)
  alphabet = "abcxyz 0123456789+-=#é\n"
  for source in (FEATURES, qwen):
    template = ChatTemplate(source, name=NAME)
    for _ in range(5):
      roles = ["system"] * rng.randint(0, 1) + ["user", "assistant"] * rng.randint(1, 3)
      messages = [
        {"role": r, "content": "".join(rng.choices(alphabet, k=rng.randint(0, 30)))} for r in roles
      ]
      for prompt in (False, True):
        expected = _plain_render(
          source, messages, add_generation_prompt=prompt, tools=None, documents=None
        )
        assert template.render(messages, add_generation_prompt=prompt) == expected
