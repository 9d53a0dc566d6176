"""Time to first token of one prompt at a time with the bucket fit on and off, on whatever
device JAX has (docs/ARCHITECTURE.md, "Bucket fit"): with the fit a prompt that passes a
bucket by less than the next one would pad runs as the bucket below and then its rest, one
more step; without, one padded step.

Each setting gets its own engine; the two run in turn, alternated `--rounds` times (on off on
off ...). For each prompt length: `--repeats` prompts of random token ids, `--new_tokens`
greedy tokens each, one at a time after a warm-up of every length; TTFT's median / min / max
over the repeats and rounds, and whether the two settings gave the same tokens.

  python -m bench.bucket_fit --ckpt gemma --prompt_lengths 70,100,150,300 \\
      --out bench/results/bucket_fit_cpu.json
"""
from __future__ import annotations

import statistics

import numpy as np
from absl import app, flags

from bench import common as C

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("ckpt", "gemma", "checkpoint name or path (random:<shape> too)")
  flags.DEFINE_string("dtype", "bfloat16", "model dtype")
  flags.DEFINE_list("prompt_lengths", ["70", "100", "150", "300"], "prompt tokens")
  flags.DEFINE_integer("new_tokens", 8, "greedy tokens per request")
  flags.DEFINE_integer("repeats", 3, "timed requests per length and round")
  flags.DEFINE_integer("rounds", 2, "times the two settings are alternated")
  flags.DEFINE_integer("max_seqs", 8, "the engine's max_seqs")
  flags.DEFINE_string("out", "bench/results/bucket_fit_cpu.json", "JSON result file")


def measure(fit: bool, prompts: dict[int, list[int]]) -> tuple[dict, dict, dict]:
  """TTFT (ms) per prompt length, its tokens, and the engine's resolved buckets."""
  from blink_jax.engine import Engine, SamplingParams
  sp = SamplingParams(max_tokens=FLAGS.new_tokens, ignore_eos=True)
  with Engine.from_checkpoint(FLAGS.ckpt, dtype=FLAGS.dtype, max_seqs=FLAGS.max_seqs,
                              bucket_fit=fit) as eng:
    for p in prompts.values():
      eng.generate(prompt_token_ids=p, sampling=sp)  # compiles the buckets it takes
    ttft, tokens = {}, {}
    for n, p in prompts.items():
      outs = [eng.generate(prompt_token_ids=p, sampling=sp) for _ in range(FLAGS.repeats)]
      ttft[n] = [1e3 * o.ttft_s for o in outs]
      tokens[n] = outs[-1].token_ids
    return ttft, tokens, {"buckets": list(eng.config.buckets)}


def main(argv):
  del argv
  lengths = [int(n) for n in FLAGS.prompt_lengths]
  rng = np.random.default_rng(0)
  prompts = {n: rng.integers(10, 20_000, n).tolist() for n in lengths}
  samples = {(fit, n): [] for fit in (True, False) for n in lengths}
  tokens, info = {}, {}
  for r in range(FLAGS.rounds):
    for fit in (True, False):
      got, tokens[fit], info = measure(fit, prompts)
      for n in lengths:
        samples[fit, n] += got[n]
      print(f"round {r + 1} fit {fit}: " + ", ".join(
          f"{n} tokens {statistics.median(got[n]):.0f} ms" for n in lengths), flush=True)
  rows = []
  for n in lengths:
    on, off = (statistics.median(samples[f, n]) for f in (True, False))
    rows.append({"prompt_tokens": n, **C.stats(samples[True, n], "ttft_ms_fit"),
                 **C.stats(samples[False, n], "ttft_ms_padded"), "ratio_fit_to_padded": on / off,
                 "same_tokens": tokens[True][n] == tokens[False][n]})
  print(C.table(rows, ["prompt_tokens", "ttft_ms_fit_median", "ttft_ms_padded_median",
                       "ratio_fit_to_padded", "same_tokens"]))
  C.write_result(FLAGS.out, "bucket_fit", rows, {
      "ckpt": FLAGS.ckpt, "dtype": FLAGS.dtype, "new_tokens": FLAGS.new_tokens,
      "repeats": FLAGS.repeats, "rounds": FLAGS.rounds, "cpu": C.cpu_model(), **info})


if __name__ == "__main__":
  define_flags()
  app.run(main)
