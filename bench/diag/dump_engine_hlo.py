"""Writes the optimized HLO of the engine's persistent loop (random weights) to a file, lists
the copy instructions inside the loop body (each becomes a memcpy node of the CUDA graph) and
counts the kernels of each bucket branch (bench/diag/hlo_kernels.py).

  python -m bench.diag.dump_engine_hlo --config gemma3-270m --out /tmp/loop_hlo.txt
  python -m bench.diag.dump_engine_hlo --config gemma3-1b --norm pallas --gemv none
"""
from __future__ import annotations

import re

from absl import app, flags

from bench import common as C
from bench.diag.hlo_kernels import computations, launches, switch_branches
from blink_jax.executor import xla_flags

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("config", "gemma3-270m", "model config name, or 'tiny'")
  flags.DEFINE_string("out", "/tmp/loop_hlo.txt", "HLO text file")
  C.define_kernel_flags()  # --attention --prefill --norm --gemv --decode_rows


def main(argv):
  del argv
  xla_flags.configure_command_buffers()
  import jax.numpy as jnp
  from flax import nnx

  from blink_jax import Engine
  from blink_jax.model.config import get_config, tiny_config
  from blink_jax.model.gemma import Gemma
  cfg = tiny_config("gemma3") if FLAGS.config == "tiny" else get_config(FLAGS.config)
  model = Gemma(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  with Engine(model, None, max_seqs=64, max_context=min(1216, cfg.max_context), page_size=16,
              num_slots=128, buckets=(1, 8, 64), max_top_logprobs=0,
              kernels=C.kernel_options()) as eng:
    text = eng.compiled.as_text()
    print("loop report", eng.loop_report)
  with open(FLAGS.out, "w") as f:
    f.write(text)
  copies = [l.strip()[:160] for l in text.splitlines() if re.search(r"= \S+ copy(-start)?\(", l)]
  print(f"{len(copies)} copy instructions in the module")
  kv_shape = f"{eng.sched.num_pages},{eng.sched.page_size},{2 * cfg.num_kv_heads * cfg.head_dim}"
  cache = [l for l in copies if f"[{kv_shape}]" in l]
  print(f"{len(cache)} of them copy a whole layer's KV cache [{kv_shape}] (should be 0)")
  for l in copies[:40]:
    print("  ", l)
  names = ["empty"] + [f"bucket {b}" for b in eng.sched.buckets]
  for pick in (min, max):
    for name, (_, count) in zip(names, switch_branches(text, pick)):
      top = ", ".join(f"{k} {v}" for k, v in count.most_common(6))
      print(f"kernels ({pick.__name__} path) {name}: {sum(count.values())} ({top})")
  # The bucket-1 branch's kernels in order (what one layer costs at batch 1), for reading.
  branch = switch_branches(text)[1][0]
  with open(FLAGS.out.replace(".txt", "") + "_bucket1_kernels.txt", "w") as f:
    f.write("\n".join(launches(computations(text), branch)) + "\n")


if __name__ == "__main__":
  define_flags()
  app.run(main)
