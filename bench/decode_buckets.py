"""Per-token time of a few concurrent streams under different step-bucket sets, on whatever
device JAX has: the decode rows of a step are padded to the next bucket, so 2 streams in an
8-row bucket pay for 8 rows (docs/ARCHITECTURE.md, "The persistent loop").

Each set gets its own engine (the buckets are compiled in); the sets run in turn, alternated
`--rounds` times (A B A B ...). For each concurrency c: c prompts of `--prompt_tokens` at once,
`--new_tokens` each, greedy; per-token time of a request = (e2e - TTFT) / (tokens - 1), the
median over the c requests, then median / min / max over `--repeats` and the rounds.

  python -m bench.decode_buckets --ckpt gemma --dtype float32 \\
      --sets "1,8,16,32,64,256;1,2,4,8,16,32,64,256" --concurrency 1,2,4 \\
      --out bench/results/decode_buckets_cpu.json
"""
from __future__ import annotations

import statistics
import time

from absl import app, flags

from bench import common as C

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("ckpt", "gemma", "checkpoint name or path (random:<shape> too)")
  flags.DEFINE_string("dtype", "float32", "model dtype")
  flags.DEFINE_string("sets", "1,8,16,32,64,256;1,2,4,8,16,32,64,256",
                      "bucket sets separated by ';' (each: increasing token counts)")
  flags.DEFINE_list("concurrency", ["1", "2", "4"], "streams decoding together")
  flags.DEFINE_integer("prompt_tokens", 20, "prompt length (tokens)")
  flags.DEFINE_integer("new_tokens", 48, "tokens generated per request")
  flags.DEFINE_integer("repeats", 3, "timed repeats per concurrency and round")
  flags.DEFINE_integer("rounds", 2, "times the sets are alternated")
  flags.DEFINE_string("out", "bench/results/decode_buckets_cpu.json", "JSON result file")


def measure(buckets: tuple[int, ...], concurrency: list[int]) -> tuple[dict, float]:
  from blink_jax.engine import Engine, SamplingParams
  sp = SamplingParams(max_tokens=FLAGS.new_tokens, ignore_eos=True)
  t0 = time.perf_counter()
  with Engine.from_checkpoint(FLAGS.ckpt, dtype=FLAGS.dtype, buckets=buckets,
                              max_seqs=max(8, *concurrency)) as eng:
    startup = time.perf_counter() - t0
    eng.generate(prompt_token_ids=[[2, 100, 200, 300]] * 2, sampling=sp)  # warm
    out = {}
    for c in concurrency:
      per = []
      for _ in range(FLAGS.repeats):
        ps = [[2] + [1000 + 7 * i + j for j in range(FLAGS.prompt_tokens - 1)] for i in range(c)]
        outs = eng.generate(prompt_token_ids=ps, sampling=sp)
        per.append(statistics.median(
            (o.e2e_s - o.ttft_s) / (len(o.token_ids) - 1) * 1e3 for o in outs))
      out[c] = per
  return out, startup


def main(argv):
  del argv
  sets = [tuple(int(x) for x in s.split(",")) for s in FLAGS.sets.split(";")]
  conc = [int(c) for c in FLAGS.concurrency]
  samples = {(s, c): [] for s in sets for c in conc}
  startups = {s: [] for s in sets}
  for r in range(FLAGS.rounds):
    for s in sets:
      got, startup = measure(s, conc)
      startups[s].append(startup)
      for c in conc:
        samples[s, c] += got[c]
      print(f"round {r + 1} buckets {s}: " + ", ".join(
          f"{c} streams {statistics.median(got[c]):.2f} ms/token" for c in conc), flush=True)
  base = {c: statistics.median(samples[sets[0], c]) for c in conc}
  rows = [{"buckets": ",".join(map(str, s)), "streams": c,
           **C.stats(samples[s, c], "ms_per_token"),
           "ratio_to_first_set": statistics.median(samples[s, c]) / base[c],
           "startup_s_median": statistics.median(startups[s])}
          for s in sets for c in conc]
  print(C.table(rows, ["buckets", "streams", "ms_per_token_median", "ms_per_token_min",
                       "ms_per_token_max", "ratio_to_first_set", "startup_s_median"]))
  C.write_result(FLAGS.out, "decode_buckets", rows, {
      "ckpt": FLAGS.ckpt, "dtype": FLAGS.dtype, "prompt_tokens": FLAGS.prompt_tokens,
      "new_tokens": FLAGS.new_tokens, "repeats": FLAGS.repeats, "rounds": FLAGS.rounds,
      "cpu": C.cpu_model()})


if __name__ == "__main__":
  define_flags()
  app.run(main)
