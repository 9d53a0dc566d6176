"""Cost of the on-device sampler (blink_jax.model.sampling.sample) per step, by what the rows
ask for: greedy, temperature alone, top-p, top-k, top-k with top-p, each at several row counts
(the engine samples min(bucket rows, max_seqs) rows every step) over the model's vocabulary.

Each point runs `steps` samples inside one device `lax.fori_loop` (no host in the timing), the
logits changed every step so nothing is hoisted; float32 logits as the output layer gives them.

  python -m bench.sampling --rows 1,64,256 --vocab 262144
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from jax import lax

from bench import common as C
from blink_jax.kernels import cuda_sampler
from blink_jax.model.sampling import sample

FLAGS = flags.FLAGS

# name -> (temperature, top_p, top_k) of every row; the values OpenAI and vLLM clients send.
MODES = {"greedy": (0.0, 1.0, 0), "temperature": (1.0, 1.0, 0), "top_p": (0.7, 0.9, 0),
         "top_k": (0.7, 1.0, 40), "top_k_p": (0.7, 0.9, 40)}


def define_flags():
  """Defined when run as a script only: tests import this module beside other absl scripts."""
  flags.DEFINE_list("rows", ["1", "64", "256"], "rows sampled per step")
  flags.DEFINE_integer("vocab", 262144, "vocabulary size (Gemma 3: 262,144)")
  flags.DEFINE_list("modes", list(MODES), f"sampling parameters of every row: {list(MODES)}")
  flags.DEFINE_list("search_ways", ["1"], "thresholds per pass of the top-k / top-p searches "
                    "(sample()'s search_ways), or 'radix': the CUDA kernel that finds them "
                    "(cuda_sampler, the engine's on a GPU); each is timed with the modes that "
                    "search")
  flags.DEFINE_integer("steps", 50, "samples per timed device loop")
  flags.DEFINE_integer("repeats", 3, "timed loops per point (median and spread reported)")
  flags.DEFINE_string("out", "bench/results/sampling.json", "JSON result file")


def sampler_loop(rows: int, steps: int, ways):
  """A jitted loop of `steps` samples of [rows, vocab] logits, the sampling parameters its
  arguments (values the compiler cannot see, as in the engine); each step's logits are the
  last step's plus a shift by its tokens (a data dependence)."""
  zeros = (jnp.zeros(rows), jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows, 0)))
  search = ({"thresholds": functools.partial(cuda_sampler.thresholds, use_kernel=True)}
            if ways == "radix" else {"search_ways": ways})

  def run(logits, temperature, top_p, top_k):
    def body(i, c):
      logits, acc = c
      tok = sample(logits, temperature, top_p, top_k, jnp.arange(rows, dtype=jnp.int32),
                   jnp.zeros(rows, jnp.int32), jnp.full(rows, i, jnp.int32),
                   -jnp.ones(rows, jnp.int32), zeros, max_top=0, **search)[0]
      return logits + (tok[:, None] % 3).astype(jnp.float32) * 1e-3, acc + tok
    return lax.fori_loop(0, steps, body, (logits, jnp.zeros(rows, jnp.int32)))

  return jax.jit(run)


def measure(rows: int, vocab: int, mode: str, ways, steps: int, repeats: int) -> dict:
  logits = jax.random.normal(jax.random.PRNGKey(rows), (rows, vocab), jnp.float32) * 3
  temperature, top_p, top_k = MODES[mode]
  args = (logits, jnp.full(rows, temperature, jnp.float32), jnp.full(rows, top_p, jnp.float32),
          jnp.full(rows, top_k, jnp.int32))
  f = sampler_loop(rows, steps, ways)
  jax.block_until_ready(f(*args))  # compile + warm
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append((time.perf_counter() - t) / steps * 1e6)
  return {"rows": rows, "vocab": vocab, "mode": mode, "search_ways": ways,
          **C.stats(times, "us_per_sample_call")}


def main(argv):
  del argv
  print(f"device {C.describe_device()}, vocab {FLAGS.vocab}")
  results = []
  for rows in (int(r) for r in FLAGS.rows):
    for mode in FLAGS.modes:
      if mode not in MODES:
        raise app.UsageError(f"--modes: {mode!r} is not one of {list(MODES)}")
      _, top_p, top_k = MODES[mode]
      searches = top_p < 1.0 or top_k > 0
      if "radix" in FLAGS.search_ways and jax.devices()[0].platform != "gpu":
        raise app.UsageError("--search_ways radix runs the CUDA kernel: it needs a GPU")
      for ways in (w if w == "radix" else int(w) for w in FLAGS.search_ways) if searches else [1]:
        results.append(measure(rows, FLAGS.vocab, mode, ways, FLAGS.steps, FLAGS.repeats))
        r = results[-1]
        print(f"rows {rows:4d} {mode:12s} ways {ways!s:5s} {r['us_per_sample_call_median']:10.1f} "
              f"us [{r['us_per_sample_call_min']:.1f}-{r['us_per_sample_call_max']:.1f}]",
              flush=True)
  C.write_result(FLAGS.out, "sampling", results, {"modes": {m: MODES[m] for m in FLAGS.modes}})


if __name__ == "__main__":
  define_flags()
  app.run(main)
