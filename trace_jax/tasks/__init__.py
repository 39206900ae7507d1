"""Verifiable-reward tasks and tokenizers."""

from trace_jax.tasks.arithmetic import Arithmetic, ArithmeticChain
from trace_jax.tasks.base import SPLITS, EnvStep, Item, Task
from trace_jax.tasks.coding import Coding
from trace_jax.tasks.search import Search
from trace_jax.tasks.registry import get_task, register, registered
from trace_jax.tasks.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from trace_jax.tasks.chat import ChatTemplate, ChatTemplateError, CheckpointTokenizer
