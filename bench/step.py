"""Cost of one model step, next to its floors: decode-step latency at several batch sizes,
prefill throughput for several prompt lengths, the HBM floor (bytes a step must read /
measured copy bandwidth), the matmul floor (FLOPs / measured bf16 matmul rate), the
scheduler's schedule+commit and an empty loop iteration; on a GPU with NVML also the energy
per decode or mixed step, total and above idle (--energy_s).

Steps run N times inside one device `lax.fori_loop` (no host in the timing); random weights.

  python -m bench.step --config gemma3-1b --batches 1,8,64,256 --prefill_lengths 128,1024,4096
  python -m bench.step --batches 1,64 --prefill_lengths 256,1024,4096 --noscheduler \
      --attention pallas --prefill pallas     # prefill steps on the Pallas prefill kernel
  python -m bench.step --batches "" --prefill_lengths 4096 --mixed 4096:0,4096:128,4096:256 \
      --noscheduler                           # a burst's steps: decode rows, then prompt chunks

Kernels: --attention --prefill --norm --gemv --decode_rows --decode_head (KernelOptions, as scripts/serve.py's
flags), picked per step size as the executor picks them.

Per-kernel time of a decode or mixed step: --profile DIR traces single steps (kernels inside a
device loop are not traced) into DIR/decode_b<batch> and DIR/mixed_t<T>_d<D>, then
`python -m bench.kernel_profile --trace DIR/decode_b1 --iterations 20`.
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from jax import lax

from bench import common as C
from blink_jax.executor import xla_flags
from blink_jax.kernels.select import step_kernels

FLAGS = flags.FLAGS


def define_flags():
  """Defined when run as a script only: tests import this module beside other absl scripts."""
  flags.DEFINE_string("config", "gemma3-1b", "model config name, or 'tiny'")
  flags.DEFINE_list("batches", ["1", "8", "64", "256"], "decode batch sizes")
  flags.DEFINE_integer("context", 1024, "context of every decoding sequence")
  flags.DEFINE_list("prefill_lengths", ["128", "1024", "4096"],
                    "prompt lengths for prefill throughput (empty: no prefill rows)")
  flags.DEFINE_list("mixed", [], "mixed steps T:D, a burst's: T tokens, the first D of them "
                    "decode rows (D sequences at --context), the rest prompt chunks of "
                    "--mixed_prompt tokens (fresh prompts); the output layer takes the first "
                    "min(T, --mixed_logit_rows) rows, as the engine's does")
  flags.DEFINE_integer("mixed_prompt", 640, "tokens of each prompt chunk of a mixed step")
  flags.DEFINE_integer("mixed_logit_rows", 256, "rows of a mixed step's output layer (the "
                       "engine's max_seqs)")
  flags.DEFINE_integer("steps", 50, "steps per timed device loop")
  flags.DEFINE_integer("repeats", 3, "timed loops per point (median and spread reported)")
  flags.DEFINE_integer("page_size", 16, "KV page size")
  flags.DEFINE_float("energy_s", 2.0, "seconds each decode and mixed point runs its timed loop "
                     "again under NVML's energy counter, for its energy per step (0: none; no "
                     "figure off a GPU or without NVML)")
  C.define_kernel_flags()  # --attention --prefill --norm --gemv --decode_rows --decode_head
  flags.DEFINE_bool("scheduler", True, "also time schedule+commit and an empty loop iteration")
  flags.DEFINE_string("out", "bench/results/step.json", "JSON result file")
  flags.DEFINE_string("profile", None, "also trace profile_steps single decode steps per batch "
                      "into DIR/decode_b<batch> (jax.profiler; python -m bench.kernel_profile reads "
                      "it)")
  flags.DEFINE_integer("profile_steps", 20, "traced steps per batch with --profile")
  flags.DEFINE_bool("command_buffers", True, "run steps as CUDA graphs (XLA command buffers); "
                    "--nocommand_buffers launches each kernel on its own")
  flags.DEFINE_integer("copy_elems", 1 << 31, "bf16 elements of the bandwidth probe")
  flags.DEFINE_integer("matmul_n", 8192, "size of the matmul-rate probe")


def timed(fn, *args, repeats: int) -> list[float]:
  jax.block_until_ready(fn(*args))  # compile + warm
  out = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    out.append(time.perf_counter() - t)
  return out


def copy_bandwidth() -> float:
  """Bytes/s of a read+write stream over the device (4 GiB by default)."""
  x = jnp.ones((FLAGS.copy_elems,), jnp.bfloat16)
  f = jax.jit(lambda x: lax.fori_loop(0, 10, lambda i, y: y + 1, x))
  t = min(timed(f, x, repeats=3))
  return 10 * 2 * x.nbytes / t


def matmul_rate() -> float:
  """bf16 FLOP/s of an n^3 product (8192 by default)."""
  a = jnp.ones((FLAGS.matmul_n, FLAGS.matmul_n), jnp.bfloat16)
  f = jax.jit(lambda a: lax.fori_loop(0, 10, lambda i, y: (y @ a) * 1e-3, a))
  t = min(timed(f, a, repeats=3))
  return 10 * 2 * FLAGS.matmul_n ** 3 / t


def step_fns(model, n_tokens: int, steps: int, logit_rows: np.ndarray, feed_back: bool):
  """A jitted loop of `steps` model steps over n_tokens rows (the output layer over
  `logit_rows`; feed_back: each step's tokens are the last step's picks, as in decode), one
  jitted step (for profiles: kernels inside a device loop are not traced), and the weights
  with each layer's fused q/k/v and gate/up copies (`Gemma.fused_weights`), made once as the
  executor makes them: without them the traced step concatenated the q/k/v weights in every
  layer (a 3.5 us kernel per layer of the 1B on an H100), which the engine never does."""
  graphdef, params = nnx.split(model)
  params = (params, jax.jit(lambda p: nnx.merge(graphdef, p).fused_weights())(params))

  platform = jax.devices()[0].platform  # the executor's choices for this bucket
  kernels = step_kernels(model.cfg, C.kernel_options().resolved(platform), n_tokens,
                         interpret=platform != "gpu")

  def one(params, kv, tokens, positions, seq_ids, pt):
    params, fused = params
    m = nnx.merge(graphdef, params)
    hidden, kv = m.forward(tokens, positions, seq_ids, pt, kv, kernels, fused=fused)
    nxt = jnp.argmax(m.logits(hidden[logit_rows]), axis=-1).astype(jnp.int32)
    return kv, nxt

  def run(params, kv, tokens, positions, seq_ids, pt):
    def body(i, c):
      kv, tokens = c
      kv, nxt = one(params, kv, tokens, positions, seq_ids, pt)
      return kv, nxt if feed_back else tokens
    return lax.fori_loop(0, steps, body, (kv, tokens))

  return jax.jit(run, donate_argnums=(1,)), jax.jit(one, donate_argnums=(1,)), params


def step_rows(kind: str, n_seqs: int, length: int, tokens: int = 0, prompt: int = 0,
              logit_rows: int = 0):
  """A step's rows: (positions, sequence ids, rows of its output layer, sequences, the
  longest context). decode: n_seqs tokens at position length - 1; prefill: one sequence's
  `length` tokens; mixed: n_seqs decode rows, then `tokens - n_seqs` rows of prompt chunks
  of `prompt` tokens (positions from 0; the engine puts decode rows first too)."""
  if kind == "decode":
    return (np.full(n_seqs, length - 1), np.arange(n_seqs), np.arange(n_seqs), n_seqs, length)
  if kind == "prefill":
    return np.arange(length), np.zeros(length, np.int64), np.array([length - 1]), 1, length
  rest = tokens - n_seqs
  chunks = -(-rest // prompt) if rest > 0 else 0
  positions = np.concatenate([np.full(n_seqs, length - 1), np.arange(rest) % prompt])
  seq_ids = np.concatenate([np.arange(n_seqs), n_seqs + np.arange(rest) // prompt])
  return (positions, seq_ids, np.arange(min(tokens, logit_rows)), n_seqs + chunks,
          max(length, min(prompt, rest)))


def measure_step(model, cfg, kind: str, n_seqs: int, length: int, steps: int, repeats: int,
                 bw: float, flops: float, tokens: int = 0) -> dict:
  from blink_jax.model.gemma import init_kv_cache
  ps = FLAGS.page_size
  positions, seq_ids, logit_rows, seqs, longest = step_rows(
      kind, n_seqs, length, tokens, FLAGS.mixed_prompt, FLAGS.mixed_logit_rows)
  pages_per_seq = -(-(longest + 1) // ps)
  kv = init_kv_cache(cfg, seqs * pages_per_seq + 1, ps, model.dtype)
  pt = jnp.arange(seqs * pages_per_seq, dtype=jnp.int32).reshape(seqs, pages_per_seq)
  n_tokens = len(positions)
  positions = jnp.asarray(positions, jnp.int32)
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, n_tokens), jnp.int32)
  fn, one, params = step_fns(model, n_tokens, steps, logit_rows, feed_back=kind == "decode")
  kv_state = {"kv": kv}

  def call():
    kv_state["kv"], _ = fn(params, kv_state["kv"], tokens, positions, seq_ids, pt)
    return kv_state["kv"]

  per = [t / steps for t in timed(lambda: call(), repeats=repeats)]
  energy = step_energy(call, steps, float(np.median(per))) if kind != "prefill" else {}
  if FLAGS.profile and kind != "prefill":
    # One step per call, traced (bench.kernel_profile --iterations profile_steps).
    kv_state["kv"], _ = jax.block_until_ready(one(params, kv_state["kv"], tokens, positions,
                                                  seq_ids, pt))  # compiled before the trace
    name = f"decode_b{n_seqs}" if kind == "decode" else f"mixed_t{n_tokens}_d{n_seqs}"
    with jax.profiler.trace(f"{FLAGS.profile}/{name}", create_perfetto_trace=True):
      for _ in range(FLAGS.profile_steps):
        kv_state["kv"], _ = one(params, kv_state["kv"], tokens, positions, seq_ids, pt)
      jax.block_until_ready(kv_state["kv"])
  weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params[0]))
  embed_bytes = model.embed[...].nbytes
  kv_row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(model.dtype).itemsize
  # Bytes a step must read: every weight once (the tied embedding as the head) and the K/V of
  # every context token of every sequence.
  ctx_tokens = n_seqs * length if kind != "prefill" else length
  if kind == "mixed":
    ctx_tokens += n_tokens - n_seqs  # each prompt token's own K/V, written and read
  floor_bytes = weight_bytes + ctx_tokens * kv_row_bytes
  matmul_params = weight_bytes - embed_bytes  # per token, 2 FLOPs per weight (+ the head)
  flop = 2 * n_tokens * (matmul_params / jnp.dtype(model.dtype).itemsize) + \
      2 * len(logit_rows) * embed_bytes / jnp.dtype(model.dtype).itemsize
  med = float(np.median(per))
  row = {"kind": kind, "batch": n_seqs, "tokens": n_tokens, "context": length,
         **C.stats([p * 1e3 for p in per], "ms_per_step"),
         "hbm_floor_ms": floor_bytes / bw * 1e3, "matmul_floor_ms": flop / flops * 1e3,
         "tokens_per_s": n_tokens / med, **energy,
         **({"prompt_chunk": FLAGS.mixed_prompt, "logit_rows": len(logit_rows)}
            if kind == "mixed" else {})}
  print({k: v for k, v in row.items() if not k.endswith("_all")}, flush=True)
  return row


def step_energy(call, steps: int, step_s: float) -> dict:
  """Energy per step of a point's timed loop `call` (`steps` steps of about step_s each),
  run again and again for --energy_s, from NVML's energy counter (bench.common.EnergyCounter);
  also above the GPUs' idle power (measured over 2 s before the first point). {} when off
  or off a GPU; a note instead without the counter."""
  if FLAGS.energy_s <= 0 or jax.devices()[0].platform != "gpu":
    return {}
  counter = C.EnergyCounter()
  if counter.reason:
    return {"energy_note": counter.reason}
  idle_w = C.idle_power()
  calls = max(1, round(FLAGS.energy_s / (steps * step_s)))
  jax.block_until_ready(call())
  with counter:
    for _ in range(calls):
      out = call()
    jax.block_until_ready(out)
  return C.energy_per("step", counter.joules, counter.seconds, calls * steps, idle_w)


def configure_xla(command_buffers: bool) -> None:
  """XLA's flags for the timed steps: the engine's (command buffers and decode flags), or,
  without command buffers, kernels launched one by one with the same decode flags
  (dot-strength-reduction off: without it the step is a different program, finding 38)."""
  if command_buffers:
    xla_flags.configure_command_buffers()
    return
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                      "--xla_gpu_enable_command_buffer=",
                                      *xla_flags.DECODE_FLAGS]).strip()


def main(argv):
  del argv
  configure_xla(FLAGS.command_buffers)
  from blink_jax.model.config import get_config, tiny_config
  from blink_jax.model.gemma import Gemma
  cfg = tiny_config("gemma3") if FLAGS.config == "tiny" else get_config(FLAGS.config)
  model = Gemma(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  bw, flops = copy_bandwidth(), matmul_rate()
  print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
  rows = []
  for b in (int(x) for x in FLAGS.batches):
    rows.append(measure_step(model, cfg, "decode", b, FLAGS.context, FLAGS.steps,
                             FLAGS.repeats, bw, flops))
  for n in (int(x) for x in FLAGS.prefill_lengths):
    rows.append(measure_step(model, cfg, "prefill", 1, n, max(FLAGS.steps // 5, 3),
                             FLAGS.repeats, bw, flops))
  for spec in FLAGS.mixed:
    t, _, d = spec.partition(":")
    rows.append(measure_step(model, cfg, "mixed", int(d or 0), FLAGS.context,
                             max(FLAGS.steps // 5, 3), FLAGS.repeats, bw, flops, tokens=int(t)))
  if FLAGS.scheduler and jax.devices()[0].platform == "gpu":
    from bench.diag import loop_probes as D
    for v in ("trivial", "ffi_sc"):
      for r in D.measure(v, [0], 20000, FLAGS.repeats):
        rows.append({"kind": "empty loop iteration" if v == "trivial" else
                     "schedule+commit (64 lanes, no requests)", "batch": 64 if v != "trivial" else 0,
                     "ms_per_step_median": r["us_per_iter_median"] / 1e3,
                     "ms_per_step_min": r["us_per_iter_min"] / 1e3,
                     "ms_per_step_max": r["us_per_iter_max"] / 1e3,
                     "kernel_ms": r.get("kernel_us_per_iter_median", 0) / 1e3})
  print(C.table(rows, ["kind", "batch", "tokens", "context", "ms_per_step_median",
                       "ms_per_step_min", "ms_per_step_max", "hbm_floor_ms", "matmul_floor_ms",
                       "tokens_per_s", "energy_per_step_j", "avg_power_w"]))
  C.write_result(FLAGS.out, "step", rows, {"config": FLAGS.config, "copy_bytes_per_s": bw,
                                          "matmul_flop_per_s": flops,
                                          "kernels": C.kernels_record(
                                              C.kernel_options(), jax.devices()[0].platform)})


if __name__ == "__main__":
  define_flags()
  app.run(main)
