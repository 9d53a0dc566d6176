"""The serving loop's temporaries against the workspace the engine reserves for them.

XLA allocates the temporaries of the whole compiled loop up front (the largest bucket branch's),
and on a GPU the engine sizes the KV cache before the compile, leaving `Executor.workspace_bytes`
for them (docs/ARCHITECTURE.md, "The engine around the loop"). Per step budget this compiles the
loop (random weights, no warm-up) and writes XLA's own figure (`memory_analysis()`'s
temp_size_in_bytes) beside the reserve and the largest float32 [rows, vocab] array.

  python -m bench.loop_memory --vocab 32768 --budgets 256,1024,4096      # a tiny model, CPU
  python -m bench.loop_memory --config gemma3-1b --budgets 256,4096      # a real shape
"""
from __future__ import annotations

import time

from absl import app, flags

from bench import common as C

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("config", "tiny", "model shape (blink_jax.model.config), or 'tiny' (the "
                      "tests' Gemma 3 shape with --vocab)")
  flags.DEFINE_integer("vocab", 32768, "vocabulary of the tiny shape")
  flags.DEFINE_list("budgets", ["256", "1024", "4096"], "step token budgets (each the "
                    "largest bucket)")
  flags.DEFINE_integer("max_seqs", 8, "sequences (a step's most samples)")
  flags.DEFINE_integer("max_top_logprobs", 4, "top logprobs per row")
  flags.DEFINE_string("dtype", "float32", "weights' dtype")
  flags.DEFINE_string("out", "bench/results/loop_memory_cpu.json", "JSON result")


def measure(cfg, budget: int, max_seqs: int, max_top_logprobs: int, dtype) -> dict:
  """One compile of the loop with `budget` as its step budget and largest bucket."""
  from flax import nnx

  from blink_jax import Engine
  from blink_jax.model.gemma import Gemma
  cfg = cfg.replace(max_context=max(cfg.max_context, budget + 64))
  model = Gemma(cfg, dtype=dtype, rngs=nnx.Rngs(0))
  t0 = time.monotonic()
  with Engine(model, None, max_seqs=max_seqs, max_context=budget + 64, num_slots=16,
              max_num_batched_tokens=budget, buckets=(1, max_seqs, budget),
              max_top_logprobs=max_top_logprobs, warm_up=False,
              compilation_cache_dir="") as eng:
    temp = int(eng.compiled.memory_analysis().temp_size_in_bytes)
    ex = eng.executor
    row = {"budget": budget, "max_seqs": max_seqs, "vocab": cfg.vocab_size,
           "temp_bytes": temp, "workspace_bytes": ex.workspace_bytes,
           # None: a tree before the prompt logprobs came in pieces
           "logit_rows": getattr(ex, "logit_rows", None),
           "budget_logits_bytes": budget * cfg.vocab_size * 4,
           "seconds": round(time.monotonic() - t0, 1)}
  return row


def main(argv):
  del argv
  import jax.numpy as jnp

  from blink_jax.model.config import get_config, tiny_config
  cfg = (tiny_config("gemma3", vocab_size=FLAGS.vocab) if FLAGS.config == "tiny"
         else get_config(FLAGS.config))
  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[FLAGS.dtype]
  rows = []
  for budget in (int(b) for b in FLAGS.budgets):
    r = measure(cfg, budget, FLAGS.max_seqs, FLAGS.max_top_logprobs, dtype)
    rows.append(r)
    print(f"budget {budget}: temporaries {r['temp_bytes'] / 2**20:.1f} MiB, workspace "
          f"{r['workspace_bytes'] / 2**20:.1f} MiB ({r['logit_rows']} logit rows); one "
          f"[budget, vocab] float32 array {r['budget_logits_bytes'] / 2**20:.1f} MiB",
          flush=True)
  C.write_result(FLAGS.out, "loop_memory", rows, {"config": cfg.name,
                                                  "dtype": FLAGS.dtype})


if __name__ == "__main__":
  define_flags()
  app.run(main)
