"""Writes the optimized HLO of the engine's persistent loop (random weights) to a file, lists
the copy instructions inside the loop body (each becomes a memcpy node of the CUDA graph) and
counts the kernels of each bucket branch (scripts/hlo_kernels.py).

  python scripts/dump_engine_hlo.py --config gemma3-270m --out /tmp/loop_hlo.txt
"""
from __future__ import annotations

import re

from absl import app, flags

from blink_jax import config, xla_flags
from hlo_kernels import computations, launches, switch_branches

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "gemma3-270m", "model config name, or 'tiny'")
flags.DEFINE_string("out", "/tmp/loop_hlo.txt", "HLO text file")
flags.DEFINE_enum("attention", "auto", config.KERNEL_KINDS, "Engine(attention=...)")
flags.DEFINE_enum("norm", "auto", config.KERNEL_KINDS, "Engine(norm=...)")


def main(argv):
  del argv
  xla_flags.configure_command_buffers()
  import jax.numpy as jnp
  from flax import nnx

  from blink_jax import Engine
  from blink_jax.config import get_config, tiny_config
  from blink_jax.model import Gemma
  cfg = tiny_config("gemma3") if FLAGS.config == "tiny" else get_config(FLAGS.config)
  model = Gemma(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  with Engine(model, None, max_seqs=64, max_context=1216, page_size=16, num_slots=128,
              buckets=(1, 8, 64), max_top_logprobs=0, attention=FLAGS.attention,
              norm=FLAGS.norm) as eng:
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
  app.run(main)
