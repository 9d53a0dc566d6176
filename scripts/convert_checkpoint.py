"""Converts a Gemma checkpoint (GGUF, Hugging Face safetensors, Gemma Flax) into our format.

  python scripts/convert_checkpoint.py --source=gguf --input=model.gguf --output=checkpoints/x
  python scripts/convert_checkpoint.py --source=gemma_flax --input=gemma3-1b/ \
      --tokenizer=tokenizer.model --output=checkpoints/gemma3-1b [--config=gemma3-1b]
"""
from __future__ import annotations

from absl import app, flags, logging

from blink_jax.weights import checkpoint
from blink_jax.weights.convert import SOURCES, convert

SOURCE = flags.DEFINE_enum("source", None, list(SOURCES), "Format of --input.")
INPUT = flags.DEFINE_string("input", None, "GGUF file, HF directory or orbax directory.")
OUTPUT = flags.DEFINE_string("output", None, "Checkpoint directory to create.")
CONFIG = flags.DEFINE_string("config", None, "Config name (blink_jax.model.config.CONFIGS) "
                             "for what the source does not state; default: inferred from the weights.")
TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.model to use instead of / in the "
                                "absence of the source's own.")
FLAGS = flags.FLAGS
flags.mark_flags_as_required(["source", "input", "output"])


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:  # orbax logs every step at INFO; -v 0 shows it
    logging.set_verbosity(logging.WARNING)
  converted = convert(SOURCE.value, INPUT.value, config=CONFIG.value, tokenizer=TOKENIZER.value)
  if converted.tokenizer_model is None:
    raise app.UsageError(f"{INPUT.value} has no tokenizer; pass --tokenizer=tokenizer.model")
  out = checkpoint.save_checkpoint(OUTPUT.value, converted.config, converted.params,
                                   converted.tokenizer_model)
  n = sum(a.size for a in _leaves(converted.params))
  print(f"wrote {out}: {converted.config.name} ({converted.config.family}, "
        f"{converted.config.num_layers} layers, {n / 1e6:.1f}M parameters)")
  print(f"  {out / checkpoint.CONFIG_FILE}\n  {out / checkpoint.PARAMS_DIR}/\n"
        f"  {out / checkpoint.TOKENIZER_FILE}")


def _leaves(tree):
  for v in tree.values():
    yield from (_leaves(v) if isinstance(v, dict) else [v])


if __name__ == "__main__":
  app.run(main)
