"""Serving load generator for any OpenAI-compatible server (ours, vLLM, SGLang).

Sends streaming /v1/completions requests (`ignore_eos: true`, fixed `max_tokens` per request)
with Poisson arrivals at each request rate of a sweep, one asyncio task per request, bounded by
--max-concurrency, and reports TTFT, TPOT, inter-token latency and end-to-end latency (mean,
p50, p90, p99), request / output-token throughput, goodput under --slo-ttft-ms/--slo-tpot-ms,
and energy per output token from NVML power samples (GPUs of this host; null with a reason
when there is no NVML). Prompts: ShareGPT v3 (--sharegpt) or a synthetic set with ShareGPT v3's
length distribution. Results: JSON (bench/common.write_result) + a PNG of latency
percentiles vs request rate.

  taskset -c 2-15 python scripts/serve.py --ckpt gemma --frontend_cpus 0,1 &   # or vLLM / SGLang
  python -m bench.serving --rates 1,2,4,inf --num-prompts 200 --label persistent \\
      --interference 32 --frontend-cpus 0,1 --slo-ttft-ms 500 --slo-tpot-ms 50
  python -m bench.serving --compare bench/results/serving_persistent.json \\
      bench/results/serving_host.json --plot-out bench/results/serving_compare.png
"""
from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import math
import os
import pathlib
import sys
import time

import numpy as np
from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from bench import common as C  # noqa: E402
from blink_jax.client.protocol import SCHEDULE_PHASES  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined when run as a script only: tests import this module beside other absl scripts."""
  flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "the server's OpenAI base URL")
  flags.DEFINE_string("model", None, "model name (default: the first of GET /models)")
  flags.DEFINE_string("api_key", None, "bearer token (default: $OPENAI_API_KEY, $BLINK_API_KEY)")
  flags.DEFINE_integer("num_prompts", 200, "requests per request rate")
  flags.DEFINE_list("rates", ["inf"], "request rates (requests/s; 'inf' sends all at once)")
  flags.DEFINE_integer("seed", 0, "seed of the prompt set and the arrival times")
  flags.DEFINE_integer("max_tokens", None, "fixed output length for every request "
                       "(default: each request's length from the dataset)")
  flags.DEFINE_integer("input_len", None, "fixed input length (overrides the dataset's)")
  flags.DEFINE_integer("output_len", None, "fixed output length (same as --max-tokens)")
  flags.DEFINE_string("sharegpt", None, "ShareGPT v3 JSON file (default: synthetic lengths)")
  flags.DEFINE_integer("shared_prefix_len", 0, "tokens of one random prefix put before every "
                       "prompt (a shared system prompt, as vLLM's prefix-repetition dataset): "
                       "what prefix caching serves from cache")
  flags.DEFINE_integer("multi_turn", 1, "turns per conversation: turn k's prompt is turn k-1's "
                       "prompt, a reply of turn k-1's output length and the next user message "
                       "(--num_prompts user messages in all); a turn is sent when the one before "
                       "it has finished, --rates are conversations' arrival rates")
  flags.DEFINE_bool("fresh_prompts", True, "each rate sends its own prompt set (seeds --seed, "
                    "--seed + 1, ...; the shared prefix stays one): with prefix caching (on by "
                    "default in blink-jax and vLLM) no rate is served from the cache of an "
                    "earlier rate's prompts; --nofresh_prompts replays one set at every rate")
  flags.DEFINE_integer("prompt_salt", 0, "draw the synthetic prompts' tokens (and the shared "
                       "prefix's, the replies') with this salt: the same --seed and another "
                       "salt sends the same lengths at the same times with other tokens, so "
                       "two runs compare like for like without one being served from the "
                       "other's prefix cache (the suite's thrasher run against its quiet run)")
  flags.DEFINE_integer("warm_cache_tokens", 0, "before the first rate, send prompts of their "
                       "own totalling this many tokens, one output token each, so that the "
                       "server's prefix cache is full and every rate runs as on a server that "
                       "has served a while (each page it takes then evicts one); 0: a fresh "
                       "server's empty cache")
  flags.DEFINE_integer("warm_cache_prompt_len", 1000, "tokens per --warm_cache_tokens prompt")
  flags.DEFINE_enum("prompt_format", "ids", ["ids", "text"], "send prompts as token ids or text")
  flags.DEFINE_string("tokenizer", None, "SentencePiece model used to tokenize ShareGPT text "
                      "(default: 4 characters per token, random ids in ids mode)")
  flags.DEFINE_integer("vocab_size", 32000, "synthetic token ids are drawn below this")
  flags.DEFINE_integer("max_context", None, "context to clip lengths to "
                       "(default: max_model_len from GET /models, else 4096)")
  flags.DEFINE_integer("max_input_len", None, "also clip prompts to this many tokens")
  flags.DEFINE_integer("max_concurrency", None, "at most this many requests in flight")
  flags.DEFINE_integer("client_procs", 1, "load-generator processes (an event loop each): one "
                       "parses some 25-30k SSE events a second, about what blink-jax streams "
                       "all at once on an H200; give them as many --client_cpus")
  flags.DEFINE_float("temperature", 0.0, "every request's temperature (0: greedy)")
  flags.DEFINE_float("top_p", None, "every request's top_p (default: not sent)")
  flags.DEFINE_integer("top_k", None, "every request's top_k (default: not sent; vLLM and "
                       "blink-jax take it as an extension of the completions API)")
  flags.DEFINE_float("slo_ttft_ms", None, "goodput SLO on TTFT")
  flags.DEFINE_float("slo_tpot_ms", None, "goodput SLO on TPOT")
  flags.DEFINE_integer("interference", 0, "N memory-thrashing processes for the whole run")
  flags.DEFINE_list("client_cpus", [], "cores of this load generator (default: "
                    "--frontend_cpus); the interference avoids them too")
  flags.DEFINE_list("frontend_cpus", [], "cores of the frontend (SmartNIC role); the "
                    "interference avoids them (empty: interference on all cores, unpinned)")
  flags.DEFINE_string("label", "default", "name of this configuration in results and plots")
  flags.DEFINE_integer("server_pid", None, "the server's main process (serve.py, vLLM's API "
                       "server): CPU seconds of it and its descendants per rate, by role")
  flags.DEFINE_string("server_info", None, "JSON file on the server (version, effective "
                      "settings: `python -m bench.peer server_info`), kept in the result")
  flags.DEFINE_string("out", None, "JSON result (default: bench/results/serving_<label>.json)")
  flags.DEFINE_bool("plot", True, "write a PNG next to the JSON")
  flags.DEFINE_string("plot_out", None, "PNG path (default: the JSON's with .png)")
  flags.DEFINE_list("compare", [], "plot these result files together (no run; with --slo_*, "
                    "goodput is recomputed from their saved requests)")
  flags.DEFINE_list("plot_percentiles", ["p50", "p90", "p99"], "latency percentiles drawn "
                    "in the plots (one, e.g. p99, keeps a many-configuration plot legible)")
  flags.DEFINE_float("request_timeout_s", 1800.0, "per-request timeout")
  flags.DEFINE_float("power_interval_ms", 50.0, "NVML power sampling interval")
  flags.DEFINE_float("idle_power_s", 3.0, "seconds of NVML power sampled with the server "
                     "idle before the first rate (idle_power_w: what the server draws with no "
                     "request; 0: skip)")

# ShareGPT v3 (vicuna, unfiltered) token lengths, first human / first gpt turn: lognormal fits.
SHAREGPT_INPUT_MEAN, SHAREGPT_INPUT_SIGMA = 1019.0, 1.0
SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA = 463.0, 1.0
MIN_LEN = 4
_WORDS = ("the of and to in is was for on that with as by at from it an be this are or his "
          "time year people way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money").split()


# ---- workload ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Req:
  prompt: list[int] | str
  input_len: int
  max_tokens: int
  follows: int | None = None  # index of the request (earlier turn) this one is sent after


def clip_lengths(inp: np.ndarray, out: np.ndarray, max_context: int,
                 max_input: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Input in [MIN_LEN, min(max_input, max_context - MIN_LEN)], output in
  [MIN_LEN, max_context - input] (what a server with that context accepts)."""
  cap = max_context - MIN_LEN
  if max_input is not None:
    cap = min(cap, max_input)
  inp = np.clip(np.asarray(inp, np.int64), MIN_LEN, cap)
  out = np.clip(np.asarray(out, np.int64), MIN_LEN, None)
  return inp, np.minimum(out, max_context - inp)


def synthetic_lengths(n: int, rng: np.random.Generator, max_context: int = 1 << 30,
                      max_input: int | None = None, input_len: int | None = None,
                      output_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(input, output) token lengths: lognormal with ShareGPT v3's means unless fixed, clipped."""
  def draw(mean, sigma):
    return np.rint(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, n)).astype(np.int64)
  inp = np.full(n, input_len) if input_len else draw(SHAREGPT_INPUT_MEAN, SHAREGPT_INPUT_SIGMA)
  out = np.full(n, output_len) if output_len else draw(SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA)
  return clip_lengths(inp, out, max_context, max_input)


def random_prompt(n: int, rng: np.random.Generator, fmt: str, vocab_size: int):
  if fmt == "ids":
    lo = min(100, vocab_size // 4)
    return [int(t) for t in rng.integers(lo, vocab_size, n)]
  return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), n))  # ~1 token per word


def salted_rng(seed: int, salt: int) -> np.random.Generator:
  """The generator of `seed`, or with a nonzero salt another one: what --prompt_salt changes
  (the tokens) against what it keeps (lengths, arrival times)."""
  return np.random.default_rng(seed if not salt else [seed, salt])


def synthetic_requests(n: int, seed: int, *, fmt: str = "ids", vocab_size: int = 32000,
                       max_context: int = 4096, max_input: int | None = None,
                       input_len: int | None = None, output_len: int | None = None,
                       salt: int = 0) -> list[Req]:
  """n requests with seed's lengths; their tokens continue seed's generator, or with a
  nonzero salt come from `salted_rng(seed, salt)`."""
  rng = np.random.default_rng(seed)
  inp, out = synthetic_lengths(n, rng, max_context, max_input, input_len, output_len)
  tokens = salted_rng(seed, salt) if salt else rng
  return [Req(random_prompt(int(i), tokens, fmt, vocab_size), int(i), int(o))
          for i, o in zip(inp, out)]


def with_shared_prefix(reqs: list[Req], n: int, seed: int, *, fmt: str = "ids",
                       vocab_size: int = 32000, max_context: int = 4096,
                       salt: int = 0) -> list[Req]:
  """The requests with one random n-token prefix before every prompt; token-id prompts are
  cut so that prefix, prompt and output still fit max_context (text prompts add about one
  token per word)."""
  if n <= 0:
    return reqs
  prefix = random_prompt(n, salted_rng(seed + 7919, salt), fmt, vocab_size)
  out = []
  for r in reqs:
    if fmt == "ids":
      own = r.prompt[:max(1, max_context - n - r.max_tokens)]
      out.append(Req(prefix + own, n + len(own), min(r.max_tokens, max_context - n - len(own))))
    else:
      out.append(Req(f"{prefix} {r.prompt}", n + r.input_len, r.max_tokens))
  return out


def multi_turn(reqs: list[Req], turns: int, seed: int, *, fmt: str = "ids",
               vocab_size: int = 32000, max_context: int = 4096, salt: int = 0) -> list[Req]:
  """Conversations of `turns` turns out of the requests (their prompts are the user messages,
  in order): turn k's prompt is turn k-1's prompt, then a reply of turn k-1's output length
  (random tokens standing in for what the server answered, so a cache can serve turn k-1's
  prompt but not the reply), then the user message; each turn follows the one before it. A
  conversation ends early when its next turn would not fit max_context: the message starts
  the next one, so every request is sent."""
  if turns <= 1:
    return reqs
  rng = salted_rng(seed + 104729, salt)
  out: list[Req] = []
  prev, turn = None, 0
  for r in reqs:
    if prev is not None and turn < turns:
      length = prev.input_len + prev.max_tokens + r.input_len
      if length + r.max_tokens <= max_context:
        reply = random_prompt(prev.max_tokens, rng, fmt, vocab_size)
        prompt = (prev.prompt + reply + r.prompt if fmt == "ids"
                  else f"{prev.prompt} {reply} {r.prompt}")
        out.append(Req(prompt, length, r.max_tokens, follows=len(out) - 1))
        prev, turn = out[-1], turn + 1
        continue
    out.append(r)  # a new conversation
    prev, turn = out[-1], 1
  return out


def sharegpt_requests(path: str, n: int, seed: int, *, fmt: str = "ids", tokenizer=None,
                      vocab_size: int = 32000, max_context: int = 4096,
                      max_input: int | None = None, input_len: int | None = None,
                      output_len: int | None = None) -> list[Req]:
  """First human turn as prompt, first gpt turn's length as output length."""
  data = json.loads(pathlib.Path(path).read_text())
  pairs = []
  for conv in data:
    turns = conv.get("conversations") or []
    human = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
    if human is None:
      continue
    gpt = next((t for t in turns[human + 1:] if t.get("from") == "gpt"), None)
    if gpt is not None and turns[human].get("value") and gpt.get("value"):
      pairs.append((turns[human]["value"], gpt["value"]))
  if not pairs:
    raise ValueError(f"{path}: no human/gpt turn pairs")
  rng = np.random.default_rng(seed)
  count = (lambda s: len(tokenizer.encode(s))) if tokenizer else (lambda s: max(1, len(s) // 4))
  out = []
  for idx in rng.permutation(len(pairs)):
    if len(out) == n:
      break
    text, answer = pairs[idx]
    ni, no = count(text), count(answer)
    if ni < MIN_LEN or no < MIN_LEN:
      continue
    ni, no = input_len or ni, output_len or no
    (ci,), (co,) = clip_lengths([ni], [no], max_context, max_input)
    if fmt == "text" and ci < ni:
      continue  # cannot cut text to a token count without the server's tokenizer
    if fmt == "ids":
      prompt = (tokenizer.encode(text)[:ci] if tokenizer and not input_len
                else random_prompt(int(ci), rng, "ids", vocab_size))
    else:
      prompt = text
    out.append(Req(prompt, int(ci), int(co)))
  if len(out) < n:  # fewer usable conversations than requests: repeat them
    out += [out[i % len(out)] for i in range(n - len(out))]
  return out


def warm_cache_requests(tokens: int, prompt_len: int, seed: int, *, fmt: str = "ids",
                        vocab_size: int = 32000, max_context: int = 4096) -> list[Req]:
  """Prompts of their own (seed's generator, none shared with a measured set) totalling
  `tokens`, each `prompt_len` long (at most max_context - 1) and asking one token: what fills
  a server's prefix cache before a measurement (--warm_cache_tokens)."""
  n = max(1, min(prompt_len, max_context - 1))
  rng = np.random.default_rng([seed, 0x5eed])
  return [Req(random_prompt(n, rng, fmt, vocab_size), n, 1) for _ in range(-(-tokens // n))]


def arrival_times(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
  """Send offsets (s) of a Poisson process at `rate` requests/s (all zero for inf)."""
  if math.isinf(rate):
    return np.zeros(n)
  return np.cumsum(rng.exponential(1.0 / rate, n))


# ---- metrics ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Record:
  input_len: int
  max_tokens: int
  start: float = 0.0                                    # seconds since the rate's start
  ok: bool = False
  error: str | None = None
  ttft: float | None = None                             # seconds
  e2e: float | None = None
  output_tokens: int = 0
  chunk_times: list[float] = dataclasses.field(default_factory=list)  # since the request's start
  sent_at: float = 0.0                                  # time.monotonic() when sent

  def itl(self) -> list[float]:
    return list(np.diff(self.chunk_times)) if len(self.chunk_times) > 1 else []

  def tpot(self) -> float | None:
    if not self.ok or self.output_tokens < 2:
      return None
    return (self.e2e - self.ttft) / (self.output_tokens - 1)


def goodput(records: list[Record], duration_s: float, slo_ttft_ms: float | None,
            slo_tpot_ms: float | None) -> dict:
  """Completed requests per second that meet both SLOs (an unset SLO always holds)."""
  out = {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms}
  if slo_ttft_ms is None and slo_tpot_ms is None:
    return {**out, "goodput": None, "good_requests": None}

  def good(r):
    tp = r.tpot()
    return (r.ok and (slo_ttft_ms is None or 1e3 * r.ttft <= slo_ttft_ms)
            and (slo_tpot_ms is None or tp is None or 1e3 * tp <= slo_tpot_ms))
  n_good = sum(good(r) for r in records)
  return {**out, "good_requests": n_good,
          "goodput": n_good / duration_s if duration_s > 0 else 0.0}


# A result's per-request records go to a gzipped file beside it, `<result stem>` + this suffix,
# which the result's "requests_file" names: they are nine tenths of a result's bytes (some 0.5 MB
# for 600 requests at 3 rates, 80 KB gzipped), and the device call that starts a lease carries
# the tree with bench/results in at most 64 MiB (bench/lease.sh).
REQUESTS_SUFFIX = ".requests.json.gz"


def requests_path(result: str | pathlib.Path) -> pathlib.Path:
  """The per-request file of the result file `result` (x.json -> x.requests.json.gz)."""
  result = pathlib.Path(result)
  return result.with_name(result.name.removesuffix(".json") + REQUESTS_SUFFIX)


def write_requests(result: str | pathlib.Path, per_request: dict) -> pathlib.Path:
  """Writes the per-request records {rate: [record, ...]} of the result file `result` beside
  it, gzipped without a timestamp (the same records, the same bytes)."""
  path = requests_path(result)
  path.write_bytes(gzip.compress(json.dumps(per_request).encode(), mtime=0))
  return path


def load_result(path: str | pathlib.Path) -> dict:
  """A result file with its per-request records under "requests": inline in older results,
  else from the file named after the result (`requests_path`, so that a result renamed with
  its records stays whole; "requests_file" says there is one)."""
  path = pathlib.Path(path)
  doc = json.loads(path.read_text())
  if "requests" not in doc and doc.get("requests_file"):
    doc["requests"] = json.loads(gzip.decompress(requests_path(path).read_bytes()))
  return doc


def records_of(saved: list[dict]) -> list[Record]:
  """Records back from a result file's per-request entries (no chunk times: no ITL)."""
  return [Record(input_len=r["input_len"], max_tokens=r["max_tokens"], start=r["start_s"],
                 ok=r["ok"], error=r["error"], ttft=r["ttft_s"], e2e=r["e2e_s"],
                 output_tokens=r["output_tokens"]) for r in saved]


def regoodput(doc: dict, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict:
  """A result document with goodput recomputed for other SLOs from its saved requests."""
  rows = [{**row, **goodput(records_of(doc["requests"][str(row["rate"])]), row["duration_s"],
                            slo_ttft_ms, slo_tpot_ms)} for row in doc["results"]]
  return {**doc, "results": rows}


def tail_s(records: list[Record]) -> float | None:
  """The run's tail, from the last request's send to the last answer's end (None: no answer):
  paced steps there saved no step and held the GPU at idle power (docs/PERFORMANCE.md,
  "Pacing factors 2.0 to 3.0 and the run's tail, 600 requests at 4, 16 and 32 req/s
  (revision 7423774)")."""
  ends = [r.start + r.e2e for r in records if r.ok]
  return max(ends) - max(r.start for r in records) if ends else None


def compute_metrics(records: list[Record], duration_s: float, slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> dict:
  ok = [r for r in records if r.ok]
  out_tok = sum(r.output_tokens for r in ok)
  m = {"num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
       "duration_s": duration_s, "input_tokens": sum(r.input_len for r in ok),
       "output_tokens": out_tok,
       "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
       "output_throughput": out_tok / duration_s if duration_s > 0 else 0.0}
  ms = lambda xs: [1e3 * x for x in xs if x is not None]  # noqa: E731
  m.update(C.percentile_stats(ms(r.ttft for r in ok), "ttft_ms"))
  m.update(C.percentile_stats(ms(r.tpot() for r in ok), "tpot_ms"))
  m.update(C.percentile_stats(ms(g for r in ok for g in r.itl()), "itl_ms"))
  m.update(C.percentile_stats(ms(r.e2e for r in ok), "e2e_ms"))
  m.update(goodput(ok, duration_s, slo_ttft_ms, slo_tpot_ms))
  if ok:
    m["tail_s"] = tail_s(records)
  errors = sorted({r.error for r in records if r.error})
  if errors:
    m["errors"] = errors[:10]
  return {**m, **vllm_bench_fields(m)}


def vllm_bench_fields(m: dict) -> dict:
  """The same figures under `vllm bench serve`'s names (its --save-result JSON), so one
  reader takes both tools' files."""
  out = {"duration": m["duration_s"], "total_input_tokens": m["input_tokens"],
         "total_output_tokens": m["output_tokens"]}
  for ours, theirs in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el")):
    for stat, name in (("mean", "mean"), ("p50", "median"), ("p99", "p99")):
      if f"{ours}_ms_{stat}" in m:
        out[f"{name}_{theirs}_ms"] = m[f"{ours}_ms_{stat}"]
  return out


# ---- energy ----------------------------------------------------------------------------------

PowerSampler = C.PowerSampler  # NVML power of this host's GPUs (bench/common.py)


# ---- host CPU of the server ------------------------------------------------------------------

# Which of a server's processes do what (docs/PERFORMANCE.md, "Serving suite"): blink-jax's
# frontend workers and vLLM's API server are the HTTP side (tokenizing, streaming: a
# SmartNIC's job in Blink); serve.py and vLLM's EngineCore drive the GPU. First match wins; a
# process matching none inherits its parent's role (a worker's parser pool is frontend), the
# root is "engine".
CPU_ROLES = (("engine", ("EngineCore",)), ("frontend", ("nic_frontend", "vllm.entrypoints")))


def _proc_stat(pid: int) -> tuple[int, float] | None:
  """(parent pid, CPU seconds in user + system mode) of a live process, from /proc."""
  try:
    text = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  fields = text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
  return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> str:
  try:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
        errors="replace")
  except OSError:
    return ""


def process_tree(root: int) -> dict[int, tuple[str, float]]:
  """{pid: (role, CPU seconds so far)} of `root` and every descendant alive now."""
  stats = {}
  for d in pathlib.Path("/proc").iterdir():
    if d.name.isdigit() and (st := _proc_stat(int(d.name))) is not None:
      stats[int(d.name)] = st
  if root not in stats:
    return {}
  children: dict[int, list[int]] = {}
  for pid, (ppid, _) in stats.items():
    children.setdefault(ppid, []).append(pid)
  out, todo = {}, [(root, "engine")]
  while todo:
    pid, inherited = todo.pop()
    cmd = _cmdline(pid)
    role = next((r for r, pats in CPU_ROLES if any(p in cmd for p in pats)), inherited)
    out[pid] = (role, stats[pid][1])
    todo += [(c, role) for c in children.get(pid, [])]
  return out


class ServerCPU:
  """CPU seconds the server's process tree spends over a `with` block, by role. A process born
  inside the block counts from zero; one that ends inside it loses its last reading's share
  (the server's processes live for the whole run)."""

  def __init__(self, root_pid: int | None):
    self.root = root_pid
    self.before: dict[int, tuple[str, float]] = {}
    self.after: dict[int, tuple[str, float]] = {}

  def __enter__(self):
    self.before = process_tree(self.root) if self.root else {}
    return self

  def __exit__(self, *exc):
    self.after = process_tree(self.root) if self.root else {}

  def result(self, output_tokens: int) -> dict:
    if not self.root:
      return {}
    if not self.after:
      return {"host_cpu_note": f"server process {self.root} not found"}
    by_role: dict[str, float] = {}
    for pid, (role, cpu) in self.after.items():
      by_role[role] = by_role.get(role, 0.0) + cpu - self.before.get(pid, (role, 0.0))[1]
    total = sum(by_role.values())
    per_1k = (lambda s: 1e3 * s / output_tokens if output_tokens else None)  # noqa: E731
    return {"host_cpu_s": total, "host_cpu_s_per_1k_tokens": per_1k(total),
            "engine_cpu_s_per_1k_tokens": per_1k(by_role.get("engine", 0.0)),
            "host_cpu_s_by_role": by_role, "server_processes": len(self.after)}


# The device loop's counters that blink's /metrics exports from the mailbox header
# (nic_frontend/metrics.py): with the output tokens they say how many model steps a token
# costs, the figure behind the energy per token (docs/PERFORMANCE.md, "Energy").
DEVICE_COUNTERS = ("steps", "loop_iterations", "tokens_generated", "prompt_tokens",
                   "prefix_cache_queries", "prefix_cache_hits", "slot_scans", "step_rows",
                   # the scheduler kernels' device time (CUDA only), read per loop iteration
                   "schedule_seconds", "commit_seconds")
# ... and the schedule kernel's time by phase (a family labelled by phase): "schedule_<phase>"
SCHEDULE_PHASE_FAMILY = "blink_gpu_schedule_phase_seconds"


# The frontend's own latency histograms: their means over a rate, measured from the moment
# its handler starts, beside the client's figures (which add the load generator's own
# delays: a way to tell the two apart under interference). TTFT's parts: prepare (body,
# validation, tokenization), queue (waiting for a slot), slot to first output (the device's
# admission and prefill, the ring, the driver's poll); the rest is the hand-off to the stream.
FRONTEND_HISTOGRAMS = {"blink_frontend_time_to_first_token_seconds": "frontend_ttft",
                       "blink_frontend_time_per_output_token_seconds": "frontend_tpot",
                       "blink_frontend_request_prepare_time_seconds": "frontend_prepare",
                       "blink_frontend_request_queue_time_seconds": "frontend_queue",
                       "blink_frontend_slot_to_first_output_seconds": "frontend_slot_first_output",
                       # the device's part of slot to first output and TPOT on the device's
                       # clock: a slower device loop, or a slower mailbox round trip or stream
                       "blink_frontend_device_time_to_first_output_seconds":
                           "device_first_output",
                       "blink_frontend_device_time_per_output_token_seconds": "device_tpot"}


# vLLM's engine-step figures under the same names: its histogram of tokens per engine step
# counts the steps (`_count`) and their tokens (`_sum`), so the energy of a step can be
# compared across the two servers (docs/PERFORMANCE.md, "Energy").
VLLM_STEP_HISTOGRAM = "vllm:iteration_tokens_total"
VLLM_COUNTERS = {"vllm:prefix_cache_queries": "prefix_cache_queries",
                 "vllm:prefix_cache_hits": "prefix_cache_hits"}


def scrape_device_counters(base_url: str, headers: dict) -> dict[str, float]:
  """The step counters of the server's /metrics ({} for a server without them)."""
  import urllib.request
  url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
  try:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
      return parse_device_counters(r.read().decode())
  except (OSError, ValueError):
    return {}


def parse_device_counters(text: str) -> dict[str, float]:
  """blink's blink_gpu_<counter>_total and frontend histograms, or vLLM's steps (its
  iteration-tokens histogram: "steps", "step_tokens") and prefix-cache counters, each summed
  over the samples of the workers or engines that export it."""
  from prometheus_client.parser import text_string_to_metric_families
  counters = {**{f"blink_gpu_{c}": c for c in DEVICE_COUNTERS}, **VLLM_COUNTERS}
  out = {}

  def add(key, value):
    out[key] = out.get(key, 0.0) + value

  for f in text_string_to_metric_families(text):
    if f.name in counters:
      for s in f.samples:
        if s.name.endswith("_total"):
          add(counters[f.name], s.value)
    elif f.name == SCHEDULE_PHASE_FAMILY:
      for s in f.samples:
        if s.name.endswith("_total"):
          add(f"schedule_{s.labels['phase']}_seconds", s.value)
    elif f.name == VLLM_STEP_HISTOGRAM:
      for s in f.samples:
        if s.name.endswith("_count"):
          add("steps", s.value)
        elif s.name.endswith("_sum"):
          add("step_tokens", s.value)
    elif f.name in FRONTEND_HISTOGRAMS:  # summed over the workers' samples
      for s in f.samples:
        if s.name.endswith(("_sum", "_count")):
          add(FRONTEND_HISTOGRAMS[f.name] + s.name[s.name.rindex("_"):], s.value)
  return out


def energy_above_idle(m: dict, idle_w: float | None) -> dict:
  """The energy a rate's run drew above the idle server's power, per output token and per
  model step: what the serving loop itself spends (docs/PERFORMANCE.md, "Energy")."""
  if idle_w is None or m.get("avg_power_w") is None:
    return {}
  joules = (m["avg_power_w"] - idle_w) * m["duration_s"]
  steps, tokens = m.get("device_steps"), m.get("output_tokens")
  out = {"energy_above_idle_per_token_j": joules / tokens if tokens else None,
         "energy_above_idle_per_step_j": joules / steps if steps else None}
  # Split (PowerSampler.split): the gaps' energy above the cold idle power, and the steps'
  # energy above it with the gaps left out.
  if m.get("gap_power_w") is not None:
    out["gap_energy_above_idle_j"] = (m["gap_power_w"] - idle_w) * m["gap_s"]
  if m.get("busy_power_w") is not None and steps:
    out["busy_energy_above_idle_per_step_j"] = (m["busy_power_w"] - idle_w) * m["busy_s"] / steps
  return out


class DeviceCounters:
  """The model steps over a `with` block: blink's device loop (steps, iterations, frontend
  latency means) or vLLM's engine steps; nothing for a server without either."""

  def __init__(self, base_url: str, headers: dict):
    self.base_url, self.headers = base_url, headers
    self.before: dict[str, float] = {}
    self.after: dict[str, float] = {}

  def __enter__(self):
    self.before = scrape_device_counters(self.base_url, self.headers)
    return self

  def __exit__(self, *exc):
    self.after = scrape_device_counters(self.base_url, self.headers)

  def result(self, output_tokens: int) -> dict:
    d = {k: self.after[k] - self.before[k] for k in self.after if k in self.before}
    if "steps" not in d:
      return {}
    steps = d["steps"]
    mean_ms = {}
    for name in FRONTEND_HISTOGRAMS.values():
      n = d.get(f"{name}_count")
      mean_ms[f"{name}_mean_ms"] = 1e3 * d[f"{name}_sum"] / n if n else None
    step_tokens = d["step_tokens"] if "step_tokens" in d else (
        d.get("tokens_generated", 0) + d.get("prompt_tokens", 0))
    iterations = d.get("loop_iterations")
    kernel_us = {f"device_{k}_us_per_iteration": 1e6 * d[f"{k}_seconds"] / iterations
                 if iterations and f"{k}_seconds" in d else None
                 for k in ("schedule", "commit", *(f"schedule_{p}" for p in SCHEDULE_PHASES))}
    return {**mean_ms, **kernel_us, "device_steps": steps, "device_loop_iterations": iterations,
            "device_steps_per_output_token": steps / output_tokens if output_tokens else None,
            "device_tokens_per_step": step_tokens / steps if steps else None,
            # the rows the steps ran (their buckets, padding included) and the padding's share
            # of them (a request's first token counts as a prompt row and an output token,
            # 1 in ~600 rows here; docs/ARCHITECTURE.md, "Step buckets and their padding")
            "device_rows_per_step": d["step_rows"] / steps if steps and "step_rows" in d else None,
            "device_padding_share": 1 - step_tokens / d["step_rows"] if d.get("step_rows") else None,
            "device_slot_scans_per_iteration":
                d["slot_scans"] / iterations if iterations and "slot_scans" in d else None,
            # prompt tokens looked up in / served from the prefix cache (vLLM's names)
            "prefix_cache_queries": d.get("prefix_cache_queries"),
            "prefix_cache_hits": d.get("prefix_cache_hits")}


# ---- client ----------------------------------------------------------------------------------

async def send_one(session, url: str, headers: dict, model: str, req: Req, rec: Record,
                   t0: float, sampling: dict | None = None):
  body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
          "ignore_eos": True, "temperature": 0.0, **(sampling or {}),
          "stream_options": {"include_usage": True}}
  start = time.perf_counter()
  rec.start, rec.sent_at = start - t0, time.monotonic()
  usage_tokens = None
  try:
    async with session.post(url, json=body, headers=headers) as resp:
      if resp.status != 200:
        rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
        return
      async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
          continue
        data = line[5:].strip()
        if data == b"[DONE]":
          break
        now = time.perf_counter() - start
        chunk = json.loads(data)
        if "error" in chunk:
          rec.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
          return
        if chunk.get("choices"):
          rec.chunk_times.append(now)
        if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
          usage_tokens = int(chunk["usage"]["completion_tokens"])
    rec.e2e = time.perf_counter() - start
    if not rec.chunk_times:
      rec.error = "no tokens streamed"
      return
    rec.ttft = rec.chunk_times[0]
    rec.output_tokens = usage_tokens if usage_tokens is not None else len(rec.chunk_times)
    rec.ok = True
  except Exception as e:
    rec.error = f"{type(e).__name__}: {e}"[:200]


def arrival_offsets(reqs: list[Req], rate: float, seed: int) -> dict[int, float]:
  """When each conversation's first turn is sent (seconds after the start; a later turn goes
  when the one it follows has finished)."""
  firsts = [i for i, r in enumerate(reqs) if r.follows is None]
  return dict(zip(firsts, arrival_times(len(firsts), rate, np.random.default_rng(seed))))


async def send_all(base_url: str, headers: dict, model: str, reqs: list[Req],
                   offsets: dict[int, float], max_concurrency: int | None, timeout_s: float,
                   progress: bool = False, sampling: dict | None = None, desc: str = "",
                   start: float | None = None) -> tuple[list[Record], float]:
  """Sends `reqs` at their offsets from one event loop; (records, seconds from the start to
  the last answer). `start`: a time.monotonic() instant to count from (the processes of one
  run share it); None: when the connection pool is open."""
  import aiohttp
  from tqdm import tqdm

  done = [asyncio.Event() for _ in reqs]  # a later turn waits for the one it follows
  sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
  recs = [Record(r.input_len, r.max_tokens) for r in reqs]
  bar = tqdm(total=len(reqs), desc=desc, disable=not progress, unit="req")
  url = base_url.rstrip("/") + "/completions"
  conn = aiohttp.TCPConnector(limit=0, force_close=False)
  async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(
      total=timeout_s)) as session:
    t0 = time.perf_counter()
    if start is not None:  # the shared instant on this process's perf_counter clock
      t0 += start - time.monotonic()

    async def one(i):
      if reqs[i].follows is not None:
        await done[reqs[i].follows].wait()
      else:
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
          await asyncio.sleep(delay)
      if sem is None:
        await send_one(session, url, headers, model, reqs[i], recs[i], t0, sampling)
      else:
        async with sem:
          await send_one(session, url, headers, model, reqs[i], recs[i], t0, sampling)
      done[i].set()
      bar.update(1)

    await asyncio.gather(*(one(i) for i in range(len(reqs))))
    duration = time.perf_counter() - t0
  bar.close()
  return recs, duration


async def run_rate(base_url: str, headers: dict, model: str, reqs: list[Req], rate: float,
                   seed: int, max_concurrency: int | None, timeout_s: float,
                   progress: bool = True, sampling: dict | None = None
                   ) -> tuple[list[Record], float]:
  return await send_all(base_url, headers, model, reqs, arrival_offsets(reqs, rate, seed),
                        max_concurrency, timeout_s, progress, sampling, desc=f"rate {rate:g}")


def _client_proc(conn, args: tuple) -> None:
  """One load-generator process of `run_rate_procs`: says it is ready, takes the shared start
  instant, sends its requests and returns its records as tuples (no class crosses)."""
  base_url, headers, model, reqs, offsets, max_concurrency, timeout_s, sampling = args
  reqs = [Req(*r) for r in reqs]
  asyncio.run(server_info(base_url, headers))  # imports and first connection before the start
  conn.send("ready")
  start = conn.recv()
  recs, duration = asyncio.run(send_all(base_url, headers, model, reqs, offsets,
                                        max_concurrency, timeout_s, sampling=sampling,
                                        start=start))
  conn.send(([dataclasses.astuple(r) for r in recs], duration))
  conn.close()


def run_rate_procs(base_url: str, headers: dict, model: str, reqs: list[Req], rate: float,
                   seed: int, max_concurrency: int | None, timeout_s: float, procs: int = 1,
                   progress: bool = True, sampling: dict | None = None
                   ) -> tuple[list[Record], float]:
  """run_rate from `procs` processes (one event loop each, on the cores this one may use):
  one Python event loop parses some 25-30k SSE events a second, about what blink-jax
  streams all at once on an H200, so one loop would be part of what it measures. The
  arrival times are drawn once, as for one process; each conversation stays in one
  process; --max_concurrency is split evenly. The processes start together at one instant
  once all are ready; the duration runs from it to the last answer of any."""
  if procs <= 1:
    return asyncio.run(run_rate(base_url, headers, model, reqs, rate, seed, max_concurrency,
                                timeout_s, progress, sampling))
  import multiprocessing as mp
  offsets = arrival_offsets(reqs, rate, seed)
  root = []
  for i, r in enumerate(reqs):
    root.append(i if r.follows is None else root[r.follows])
  groups: list[list[int]] = [[] for _ in range(procs)]
  order = {c: k for k, c in enumerate(dict.fromkeys(root))}
  for i in range(len(reqs)):
    groups[order[root[i]] % procs].append(i)
  conc = -(-max_concurrency // procs) if max_concurrency else None
  ctx = mp.get_context("spawn")  # no fork of a process with threads (the power sampler)
  children = []
  for idx in (g for g in groups if g):
    local = {i: k for k, i in enumerate(idx)}
    sub = [(reqs[i].prompt, reqs[i].input_len, reqs[i].max_tokens,
            local[reqs[i].follows] if reqs[i].follows is not None else None) for i in idx]
    args = (base_url, headers, model, sub, {local[i]: offsets[i] for i in idx if i in offsets},
            conc, timeout_s, sampling)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_client_proc, args=(child, args), daemon=True)
    proc.start()
    child.close()  # only the process holds it now: if it dies, recv() here ends with EOFError
    children.append((idx, parent, proc))
  try:
    for _, parent, _ in children:
      if parent.recv() != "ready":
        raise RuntimeError("a load-generator process did not start")
    start = time.monotonic() + 0.05
    for _, parent, _ in children:
      parent.send(start)
    recs: list[Record | None] = [None] * len(reqs)
    duration = 0.0
    for idx, parent, _ in children:
      rows, d = parent.recv()
      duration = max(duration, d)
      for i, row in zip(idx, rows):
        recs[i] = Record(*row)
  finally:
    for _, _, proc in children:
      proc.join(10)
      if proc.is_alive():
        proc.kill()
  if progress:
    print(f"rate {rate:g}: {len(reqs)} requests from {len(children)} processes")
  return recs, duration


async def server_info(base_url: str, headers: dict) -> dict:
  import aiohttp
  try:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
      async with s.get(base_url.rstrip("/") + "/models", headers=headers) as r:
        data = (await r.json())["data"]
        return data[0] if data else {}
  except Exception as e:
    print(f"GET /models failed ({e}); pass --model and --max-context")
    return {}


# ---- plots -----------------------------------------------------------------------------------

def _rate_positions(rates: list[float]) -> tuple[dict, list, list]:
  finite = sorted({r for r in rates if not math.isinf(r)})
  inf_x = (finite[-1] * 2 if finite else 1.0)
  pos = {r: (inf_x if math.isinf(r) else r) for r in set(rates)}
  ticks = sorted(set(pos.values()))
  labels = ["inf" if any(math.isinf(r) and pos[r] == x for r in pos) else f"{x:g}" for x in ticks]
  return pos, ticks, labels


def plot_results(docs: list[tuple[str, list[dict]]], path: str | pathlib.Path,
                 percentiles=("p50", "p90", "p99")) -> pathlib.Path:
  """Latency percentiles, throughput and energy vs request rate, one color per (label, rows).

  The energy panels (J per output token from NVML, model steps per output token) are issue
  25's bound and its cause (docs/PERFORMANCE.md, "Known gaps"); a run without them (a CPU
  server, no NVML) leaves them empty."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rates = [float(r["rate"]) for _, rows in docs for r in rows]
  pos, ticks, tick_labels = _rate_positions(rates)
  panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
            ("e2e_ms", "end-to-end latency (ms)")]
  fig, axes = plt.subplots(2, 4, figsize=(20, 8))
  axes = axes.ravel()
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for k, (label, rows) in enumerate(docs):
    rows = sorted(rows, key=lambda r: pos[float(r["rate"])])
    x = [pos[float(r["rate"])] for r in rows]
    c = colors[k % len(colors)]
    for ax, (key, title) in zip(axes, panels):
      for pct, style in (("p50", "-"), ("p90", ":"), ("p99", "--")):
        if pct not in percentiles:
          continue
        y = [r.get(f"{key}_{pct}", float("nan")) for r in rows]
        ax.plot(x, y, style, color=c, marker="o", ms=3, label=f"{label} {pct}")
      ax.set_title(title)
    axes[4].plot(x, [r["output_throughput"] for r in rows], "-o", color=c, ms=3, label=label)
    axes[4].set_title("output tokens/s")
    axes[5].plot(x, [r["request_throughput"] for r in rows], "-o", color=c, ms=3,
                 label=f"{label} completed")
    if any(r.get("goodput") is not None for r in rows):
      axes[5].plot(x, [r.get("goodput") if r.get("goodput") is not None else float("nan")
                       for r in rows], "--s", color=c, ms=3, label=f"{label} goodput")
    axes[5].set_title("requests/s")
    for ax, key, title in ((axes[6], "energy_per_token_j", "energy per output token (J)"),
                           (axes[7], "device_steps_per_output_token",
                            "model steps per output token")):
      ax.plot(x, [r.get(key) if r.get(key) is not None else float("nan") for r in rows], "-o",
              color=c, ms=3, label=label)
      ax.set_title(title)
      ax.set_yscale("log")
  for ax in axes:
    ax.set_xscale("log" if len(ticks) > 1 and ticks[0] > 0 else "linear")
    ax.set_xticks(ticks)
    ax.set_xticklabels(tick_labels)
    # The rates are the x ticks; a log y axis spanning under a decade (the energy panels)
    # keeps its minor ticks, its only labelled ones.
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("request rate (req/s)")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  axes[4].legend(fontsize=7)
  axes[5].legend(fontsize=7)
  axes[6].legend(fontsize=7)
  fig.tight_layout()
  out = pathlib.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  print(f"wrote {out}")
  return out


def doc_label(doc: dict) -> str:
  label = doc.get("label") or doc.get("benchmark", "?")
  n = doc.get("interference") or 0
  return f"{label} +{n} thrash" if n and "thrash" not in label and "interf" not in label else label


# ---- main ------------------------------------------------------------------------------------

TABLE_COLS = ["label", "rate", "completed", "failed", "request_throughput", "output_throughput",
              "goodput", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
              "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "energy_per_token_j"]
# blink's device loop per rate (printed when the server exports it): TPOT and the device's
# part of TTFT on the device clock, and the scheduler kernels' time per loop iteration by phase
DEVICE_TABLE_COLS = ["label", "rate", "device_tpot_mean_ms", "device_first_output_mean_ms",
                     "device_tokens_per_step", "device_commit_us_per_iteration",
                     "device_schedule_us_per_iteration",
                     *(f"device_schedule_{p}_us_per_iteration" for p in SCHEDULE_PHASES),
                     "device_slot_scans_per_iteration"]

ENERGY_TABLE_COLS = ["label", "rate", "avg_power_w", "busy_s", "busy_power_w",
                     "busy_sm_clock_mhz", "busy_gpu_temp_c", "gap_s", "gap_power_w",
                     "gap_sm_clock_mhz", "gap_gpu_temp_c", "gap_energy_above_idle_j",
                     "energy_above_idle_per_step_j", "busy_energy_above_idle_per_step_j"]


def parse_rate(s: str) -> float:
  return float("inf") if s.strip().lower() in ("inf", "infinity") else float(s)


def normalize_argv(argv: list[str]) -> list[str]:
  """--base-url -> --base_url, --no-plot -> --noplot (absl's spelling), up to a bare '--'."""
  out = list(argv[:1])
  for i, a in enumerate(argv[1:], 1):
    if a == "--":
      return out + argv[i:]
    if a.startswith("--"):
      name, eq, val = a[2:].partition("=")
      if name.startswith("no-"):  # --no-plot -> --noplot
        name = "no" + name[3:]
      a = "--" + name.replace("-", "_") + eq + val
    out.append(a)
  return out


def warm_cache(headers: dict, model: str, max_context: int) -> dict:
  """Sends the --warm_cache_tokens prompts (at most --max_concurrency, else 256, in flight)
  and says what they took; a failed one fails the run, as it would leave the cache short."""
  reqs = warm_cache_requests(FLAGS.warm_cache_tokens, FLAGS.warm_cache_prompt_len, FLAGS.seed,
                             fmt=FLAGS.prompt_format, vocab_size=FLAGS.vocab_size,
                             max_context=max_context)
  print(f"warming the cache: {len(reqs)} prompts of {reqs[0].input_len} tokens")
  recs, duration = run_rate_procs(FLAGS.base_url, headers, model, reqs, float("inf"),
                                 FLAGS.seed, FLAGS.max_concurrency or 256,
                                 FLAGS.request_timeout_s, FLAGS.client_procs, progress=False)
  failed = [r.error for r in recs if not r.ok]
  if failed:
    raise RuntimeError(f"{len(failed)} of {len(recs)} cache-warming requests failed, e.g. "
                       f"{failed[0]}")
  return {"requests": len(recs), "prompt_tokens": sum(r.input_len for r in reqs),
          "duration_s": duration}


def main(argv):
  files = [*FLAGS.compare, *argv[1:]]  # --compare a.json b.json: b.json arrives positional
  if len(argv) > 1 and not FLAGS.compare:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.prompt_salt and FLAGS.sharegpt:
    raise app.UsageError("--prompt_salt draws synthetic tokens; ShareGPT's prompts are texts")
  if files:
    docs = [load_result(p) for p in files]
    if FLAGS.slo_ttft_ms is not None or FLAGS.slo_tpot_ms is not None:
      docs = [regoodput(d, FLAGS.slo_ttft_ms, FLAGS.slo_tpot_ms) for d in docs]
    out = FLAGS.plot_out or str(pathlib.Path(files[0]).with_name("serving_compare.png"))
    for d in docs:
      print(C.table([{**r, "label": doc_label(d)} for r in d["results"]], TABLE_COLS))
    plot_results([(doc_label(d), d["results"]) for d in docs], out, FLAGS.plot_percentiles)
    return

  key = FLAGS.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("BLINK_API_KEY")
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  info = asyncio.run(server_info(FLAGS.base_url, headers))
  model = FLAGS.model or info.get("id")
  if not model:
    raise app.UsageError("--model is required (GET /models gave none)")
  max_context = FLAGS.max_context or info.get("max_model_len") or 4096
  output_len = FLAGS.max_tokens or FLAGS.output_len
  common = dict(fmt=FLAGS.prompt_format, vocab_size=FLAGS.vocab_size, max_context=max_context,
                max_input=FLAGS.max_input_len, input_len=FLAGS.input_len, output_len=output_len)
  tok = None
  if FLAGS.sharegpt and FLAGS.tokenizer:
    from blink_jax.client.tokenizer import Tokenizer
    tok = Tokenizer(FLAGS.tokenizer)

  def build(seed: int) -> list[Req]:
    """The prompt set of `seed`; the shared prefix is --seed's whatever `seed` is (one
    system prompt for the whole run)."""
    if FLAGS.sharegpt:
      reqs = sharegpt_requests(FLAGS.sharegpt, FLAGS.num_prompts, seed, tokenizer=tok, **common)
    else:
      reqs = synthetic_requests(FLAGS.num_prompts, seed, salt=FLAGS.prompt_salt, **common)
    reqs = with_shared_prefix(reqs, FLAGS.shared_prefix_len, FLAGS.seed,
                              fmt=FLAGS.prompt_format, vocab_size=FLAGS.vocab_size,
                              max_context=max_context, salt=FLAGS.prompt_salt)
    return multi_turn(reqs, FLAGS.multi_turn, seed, fmt=FLAGS.prompt_format,
                      vocab_size=FLAGS.vocab_size, max_context=max_context,
                      salt=FLAGS.prompt_salt)
  rates = [parse_rate(r) for r in FLAGS.rates]
  reqs = build(FLAGS.seed)
  # With --fresh_prompts rate k sends set seed + k: no rate finds another's prompts cached.
  sets = [build(FLAGS.seed + k) if FLAGS.fresh_prompts and k else reqs
          for k in range(len(rates))]

  frontend_cpus = sorted(int(c) for c in FLAGS.frontend_cpus)
  client_cpus = sorted(int(c) for c in FLAGS.client_cpus) or frontend_cpus
  all_cpus = set(os.sched_getaffinity(0))
  interference_cpus = sorted(all_cpus - set(frontend_cpus) - set(client_cpus))
  if FLAGS.interference and not interference_cpus:
    raise app.UsageError("--frontend-cpus leaves no core for the interference")
  print(f"model {model}, context {max_context}, {len(reqs)} prompts "
        f"(input mean {np.mean([r.input_len for r in reqs]):.0f}, output mean "
        f"{np.mean([r.max_tokens for r in reqs]):.0f} tokens), rates {FLAGS.rates}, "
        f"interference {FLAGS.interference} on cpus "
        f"{'all' if not frontend_cpus else interference_cpus}")

  if client_cpus:  # the load generator stands for the network side: by default with the frontend
    os.sched_setaffinity(0, set(client_cpus))
  sampler = PowerSampler(FLAGS.power_interval_ms / 1e3)
  cpu = ServerCPU(FLAGS.server_pid)
  counters = DeviceCounters(FLAGS.base_url, headers)
  procs = C.start_interference(FLAGS.interference, set(interference_cpus), 24 * 3600) \
      if FLAGS.interference else []
  rows, per_request = [], {}
  warm = {}

  def idle_power() -> dict:
    """The server's idle draw over --idle_power_s ({} without NVML or when off): from the
    energy counter where there is one, since the sampled power (a one-second average on
    Hopper) still carries the end of a rate run just before it."""
    if FLAGS.idle_power_s <= 0 or not sampler.handles:
      return {}
    with sampler:
      time.sleep(FLAGS.idle_power_s)
    r = sampler.result(0)
    if r.get("counter_avg_power_w") is not None:
      r["avg_power_w"] = r["counter_avg_power_w"]
    return r

  idle = idle_end = {}
  sampling = {"temperature": FLAGS.temperature,
              **({"top_p": FLAGS.top_p} if FLAGS.top_p is not None else {}),
              **({"top_k": FLAGS.top_k} if FLAGS.top_k is not None else {})}
  try:
    if procs:
      time.sleep(1.0)  # let the thrashers fill their buffers
    if FLAGS.warm_cache_tokens > 0:
      warm = warm_cache(headers, model, max_context)
    idle = idle_power()
    for k, rate in enumerate(rates):
      with sampler, cpu, counters:
        recs, duration = run_rate_procs(
            FLAGS.base_url, headers, model, sets[k], rate, FLAGS.seed + 1000 * (k + 1),
            FLAGS.max_concurrency, FLAGS.request_timeout_s, FLAGS.client_procs,
            sampling=sampling)
      m = compute_metrics(recs, duration, FLAGS.slo_ttft_ms, FLAGS.slo_tpot_ms)
      m.update(sampler.result(m["output_tokens"]))
      m.update(sampler.split([(r.sent_at, r.sent_at + r.e2e) for r in recs
                              if r.e2e is not None]))
      m.update(cpu.result(m["output_tokens"]))
      m.update(counters.result(m["output_tokens"]))
      m.update(energy_above_idle(m, idle.get("avg_power_w")))
      rows.append({"label": FLAGS.label, "rate": "inf" if math.isinf(rate) else rate,
                   "max_concurrency": FLAGS.max_concurrency, **m})
      per_request[str(rows[-1]["rate"])] = [
          {"input_len": r.input_len, "max_tokens": r.max_tokens, "ok": r.ok, "error": r.error,
           "start_s": r.start, "ttft_s": r.ttft, "e2e_s": r.e2e,
           "output_tokens": r.output_tokens, "chunks": len(r.chunk_times)} for r in recs]
    # Idle again after the last rate, with the GPU warmer than before the first
    # (docs/PERFORMANCE.md, "Where a served step's energy goes (revision faba37c)").
    idle_end = idle_power()
  finally:
    for p in procs:
      p.terminate()
    for p in procs:
      p.wait()

  extra = {"label": FLAGS.label, "base_url": FLAGS.base_url, "model": model,
           "max_context": max_context, "dataset": FLAGS.sharegpt or "synthetic-sharegpt-v3",
           "prompt_format": FLAGS.prompt_format, "seed": FLAGS.seed,
           "prompt_salt": FLAGS.prompt_salt,
           "num_prompts": FLAGS.num_prompts, "shared_prefix_len": FLAGS.shared_prefix_len,
           "multi_turn": FLAGS.multi_turn, "fresh_prompts": FLAGS.fresh_prompts,
           "max_concurrency": FLAGS.max_concurrency, "sampling": sampling,
           "client_procs": FLAGS.client_procs,
           "interference": FLAGS.interference,
           "frontend_cpus": frontend_cpus or None, "client_cpus": client_cpus or None,
           "interference_cpus": (interference_cpus if frontend_cpus else "all")
           if FLAGS.interference else None,
           "energy_note": sampler.reason, "idle_power_w": idle.get("avg_power_w"),
           "idle_gpu_temp_c": idle.get("gpu_temp_c_mean"),
           "idle_power_w_end": idle_end.get("avg_power_w"),
           "idle_gpu_temp_c_end": idle_end.get("gpu_temp_c_mean"),
           "warm_cache": warm or None}
  if FLAGS.server_info:
    extra["server_info"] = json.loads(pathlib.Path(FLAGS.server_info).read_text())
  out = FLAGS.out or f"bench/results/serving_{FLAGS.label}.json"
  extra["requests_file"] = requests_path(out).name
  path = C.write_result(out, "serving", rows, extra)
  print(f"wrote {write_requests(path, per_request)}")
  print(C.table(rows, TABLE_COLS))
  if any(r.get("device_loop_iterations") for r in rows):
    print(C.table(rows, DEVICE_TABLE_COLS))
  if any(r.get("gap_power_w") is not None for r in rows):
    print(C.table(rows, ENERGY_TABLE_COLS))
  if FLAGS.plot:
    try:
      plot_results([(doc_label(extra), rows)], FLAGS.plot_out or path.with_suffix(".png"),
                   FLAGS.plot_percentiles)
    except ImportError:
      print("matplotlib is not installed: no plot (pip install .[bench])")


if __name__ == "__main__":
  sys.argv = normalize_argv(sys.argv)
  define_flags()
  app.run(main)
