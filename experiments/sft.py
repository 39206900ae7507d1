"""SFT warm start on a task's solver demonstrations (the main job runs it when needed).

  python experiments/sft.py --task=arith --preset=tiny --workdir=runs/warm --steps=200

Writes <workdir>/warmstart/ (params + warmstart.json); `experiments/rl.py --workdir=<same>`
then starts from it. Prints the greedy FP4 and bf16 reward of the result.
"""

from absl import app, flags, logging
import jax
import numpy as np
from flax import nnx

from trace_jax.model.config import get_preset
from trace_jax.model.transformer import Transformer
from trace_jax.rl import episodes
from trace_jax.run import warmstart
from trace_jax.run.rundir import check_workdir
from trace_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig
from trace_jax.tasks import CharTokenizer, get_task
from trace_jax.rl.data import eval_seed, prompt_ids

_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the warm start.", required=True)
_TASK = flags.DEFINE_string("task", "arith", "Task.")
_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset.")
_STEPS = flags.DEFINE_integer("steps", 200, "SFT steps.")
_BATCH = flags.DEFINE_integer("batch", 32, "Demonstrations per step.")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed.")
_EVAL = flags.DEFINE_integer("eval_size", 64, "Greedy evaluation problems.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
  try:
    task = get_task(_TASK.value)
    preset = get_preset(_PRESET.value)
    workdir = check_workdir(_WORKDIR.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  tokenizer = CharTokenizer()
  policy = Transformer(
    preset.replace(vocab_size=max(preset.vocab_size, tokenizer.vocab_size)),
    rngs=nnx.Rngs(_SEED.value),
  )
  record = warmstart.load_or_train(
    policy,
    workdir,
    task,
    tokenizer,
    steps=_STEPS.value,
    batch=_BATCH.value,
    seed=_SEED.value,
    learning_rate=_LR.value,
    source=warmstart.source_settings(model=_PRESET.value),  # rl.py's for this preset
  )
  items = task.evaluation_items(eval_seed(_SEED.value), _EVAL.value)
  prompt_len = max(len(prompt_ids(tokenizer, i)) for i in items)
  max_len = episodes.max_len_for(task, prompt_len, 32, 16)
  for precision in ("fp4", "bf16"):
    engine = RolloutEngine(
      policy,
      RolloutConfig(
        precision=precision,
        guidance="none",
        record_routing=False,
        max_len=max_len,
        sampling=SamplingConfig(greedy=True, max_new_tokens=32, stop_tokens=(tokenizer.eos_id,)),
      ),
    )
    played = episodes.play(engine, task, tokenizer, items, jax.random.key(0))
    record[f"eval_reward_{precision}"] = float(np.mean(played.rewards))
  print(record)


if __name__ == "__main__":
  app.run(main)
