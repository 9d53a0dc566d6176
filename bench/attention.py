"""A step's attention alone, ours against vLLM's: per layer, the attention `kernels.select`
picks for a decode step of B sequences or a mixed step (D decode rows, then prompt chunks, as
`bench.step --mixed T:D` builds it), at a sliding-window layer and at a global one, against
the FlashAttention 3 kernel vLLM 0.26 runs on Hopper (`vllm.vllm_flash_attn
.flash_attn_varlen_func` over a block table, its FLASH_ATTN backend's call) on the same
pages: microseconds per layer, the K/V bytes the layer must read and the bandwidth that
makes, joules per layer on a GPU, and how far the two outputs are apart.

Why: at 16-32 req/s our served step costs 1.2-1.3x vLLM's energy above idle for the same
tokens a step, and in a 1,024-row mixed step attention is 36 % of the kernel time, far from
its floor (docs/PERFORMANCE.md, "Pacing that holds while requests keep arriving, against
vLLM at 4, 16 and 32 req/s (revision d27bbfa)"). This says, kernel against kernel, where
ours is behind vLLM's and by how much.

Each point runs `--steps` rounds in one device loop run as a CUDA graph (XLA's command
buffers; vLLM's side a captured torch CUDA graph), each round attending over each of
`copies` K/V caches in turn, together at least --kv_mb (default 256 MiB, several times an
H100's 50 MB of L2) so the pages come from HBM as a step's 26 layers' do; each call's query
takes one element from the last output (a data dependence, so nothing is hoisted; that
small kernel is in every figure). bf16, random values; every sequence's pages its own.

  python -m bench.attention --config gemma3-1b --batches 16,64 --mixed 1024:48
  VLLM_SITE=/tmp/vllm/site python -m bench.attention --variants ours,vllm
"""
from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

from bench import common as C
from bench.step import step_rows
from blink_jax.executor import xla_flags
from blink_jax.kernels import pallas_attention, pallas_prefill
from blink_jax.kernels.select import head_then_rest, step_kernels
from blink_jax.model.config import get_config, tiny_config

FLAGS = flags.FLAGS
VARIANTS = ("ours", "vllm")


def define_flags():
  """Defined when run as a script only: tests import this module beside other absl scripts."""
  flags.DEFINE_string("config", "gemma3-1b", "model shape ('tiny': the tests' Gemma 3)")
  flags.DEFINE_list("batches", ["16", "64"], "decode steps of B sequences at --context")
  flags.DEFINE_list("mixed", ["1024:48"], "mixed steps T:D (bench.step's): T rows, the first "
                    "D decode rows at --context, then prompt chunks of --mixed_prompt")
  flags.DEFINE_integer("mixed_prompt", 640, "tokens of each prompt chunk of a mixed step")
  flags.DEFINE_integer("context", 1024, "context of every decoding sequence")
  flags.DEFINE_integer("page_size", 16, "tokens per KV page (vLLM's block size)")
  flags.DEFINE_list("variants", list(VARIANTS), f"whose attention: {list(VARIANTS)}")
  flags.DEFINE_list("prefill_configs", [], "more rows of ours for the mixed steps, the "
                    "prefill kernel at other settings: R:W:S[:K[:P]] = query rows a program, "
                    "Triton warps, pipeline stages, splits, pages a block (the engine's: "
                    "64:4:2, K and P its defaults)")
  flags.DEFINE_list("decode_configs", [], "more rows of ours for the decode steps, the "
                    "decode kernel at other settings: P:W:S[:K] = pages a block (0: its "
                    "default), Triton warps, pipeline stages, splits a row (the engine's: "
                    "0:4:1, K shared out among the live rows)")
  flags.DEFINE_string("vllm_path", os.environ.get("VLLM_SITE", "/tmp/vllm/site"),
                      "vLLM's site-packages (bench/vllm_install.sh unpacks them there)")
  flags.DEFINE_integer("kv_mb", 256, "MiB of distinct K/V caches each loop reads in turn")
  flags.DEFINE_integer("steps", 50, "rounds per timed device loop")
  flags.DEFINE_integer("repeats", 3, "timed loops per point (median and spread reported)")
  flags.DEFINE_float("energy_s", 1.0, "seconds each point's loop runs again under NVML's "
                     "energy counter (0: no energy)")
  flags.DEFINE_string("out", "bench/results/attention.json", "JSON result file")
  C.define_kernel_flags()  # --attention --prefill --norm --gemv --decode_rows --decode_head


class Case:
  """One step's rows (`bench.step.step_rows`) and its pages: sequence s holds pages [s * n,
  (s + 1) * n) of a cache of `num_pages` (one more, unused), n enough for its longest
  context."""

  def __init__(self, kind: str, n_seqs: int, context: int, tokens: int = 0, prompt: int = 0,
               page_size: int = 16):
    self.kind, self.n_seqs, self.context = kind, n_seqs, context
    positions, seq_ids, _, seqs, longest = step_rows(kind, n_seqs, context, tokens, prompt)
    self.positions = np.asarray(positions, np.int32)
    self.seq_ids = np.asarray(seq_ids, np.int32)
    self.seqs, self.page_size = seqs, page_size
    self.pages_per_seq = -(-(longest + 1) // page_size)
    self.num_pages = seqs * self.pages_per_seq + 1
    self.page_table = np.arange(seqs * self.pages_per_seq,
                                dtype=np.int32).reshape(seqs, self.pages_per_seq)
    self.name = f"decode {n_seqs}" if kind == "decode" else f"mixed {len(self.positions)}:{n_seqs}"

  @property
  def rows(self) -> int:
    return len(self.positions)

  def runs(self) -> list[tuple[int, int, int]]:
    """(sequence, first row, rows) of each run of one sequence's rows, in row order."""
    out, start = [], 0
    for i in range(1, self.rows + 1):
      if i == self.rows or self.seq_ids[i] != self.seq_ids[start]:
        out.append((int(self.seq_ids[start]), start, i - start))
        start = i
    return out

  def keys_read(self, window: int | None) -> int:
    """Keys a layer must read at the least: each sequence's keys up to its last row once,
    those in some row's window."""
    total = 0
    for _, first, n in self.runs():
      last = int(self.positions[first + n - 1])
      lo = 0 if window is None else max(0, int(self.positions[first]) - window + 1)
      total += last + 1 - lo
    return total


def copies_for(case: Case, cache_row_bytes: int, kv_mb: int) -> int:
  """Distinct K/V caches that together hold at least kv_mb MiB."""
  return C.copies_holding(kv_mb, case.num_pages * case.page_size * cache_row_bytes)


def our_attention(cfg, rows: int, options, settings: dict | None = None):
  """The engine's attention for a step of `rows` rows (`select.step_kernels` with
  KernelOptions `options` resolved on this device) and the group size if it takes the query
  grouped by KV head and padded (the decode kernel does when the q/k prepare kernel writes
  it so), else None. settings: the step's Pallas kernel at other settings (a decode step's
  decode kernel, `decode_settings`; a prefill-sized step's prefill kernel,
  `prefill_settings`)."""
  platform = jax.devices()[0].platform
  kernels = step_kernels(cfg, options.resolved(platform), rows, interpret=platform != "gpu")
  attention = kernels.attention
  if attention is None:
    from blink_jax.model.attention import paged_attention_reference
    attention = paged_attention_reference
  if settings:
    attention = with_settings(attention, settings)
  return attention, getattr(attention, "keywords", {}).get("group")


def with_settings(attention, settings: dict):
  """select's attention with its Pallas kernel at `settings`: the decode kernel of a decode
  step, the prefill kernel of a prefill-sized one (alone or after the decode head)."""
  func = getattr(attention, "func", None)
  if func in (pallas_attention.paged_decode_attention,
              pallas_prefill.paged_prefill_attention):
    return functools.partial(attention, **settings)
  if func is head_then_rest:
    rest = functools.partial(attention.keywords["rest_fn"], **settings)
    return functools.partial(attention, rest_fn=rest)
  raise ValueError(f"this step's attention runs no Pallas kernel: {attention}")


def _fields(spec: str, most: int = 4) -> list[int]:
  """A:W:S[:K...] -> its integers, the absent ones (up to `most`) 0."""
  parts = [int(x) for x in spec.split(":")]
  if not 3 <= len(parts) <= most:
    raise ValueError(f"a kernel setting is A:W:S or A:W:S:K{':P' * (most > 4)}, got {spec!r}")
  return parts + [0] * (most - len(parts))


def prefill_settings(spec: str) -> dict:
  """R:W:S[:K[:P]] -> the prefill kernel's block_rows, num_warps, num_stages, splits (K)
  and pages_per_block (P) (K, P: its defaults when absent or 0)."""
  rows, warps, stages, splits, pages = _fields(spec, most=5)
  return {"block_rows": rows, "num_warps": warps, "num_stages": stages,
          "splits": splits or None, "pages_per_block": pages or None}


def decode_settings(spec: str) -> dict:
  """P:W:S[:K] -> the decode kernel's pages_per_block (0: its default), num_warps,
  num_stages and splits (K, every row's; 0 or absent: shared out among the live rows)."""
  pages, warps, stages, splits = _fields(spec)
  return {"pages_per_block": pages or None, "num_warps": warps, "num_stages": stages,
          "splits": splits or None}


def grouped_query(q: jax.Array, group: int | None, num_kv_heads: int) -> jax.Array:
  """q [T, H, h] in the layout the attention takes: as is, or [T, K, R, h] (R: the group
  padded to `pallas_attention.query_rows`)."""
  if group is None:
    return q
  from blink_jax.kernels.pallas_attention import query_rows
  tokens, _, head_dim = q.shape
  qg = q.reshape(tokens, num_kv_heads, group, head_dim)
  return jnp.pad(qg, ((0, 0), (0, 0), (0, query_rows(group) - group), (0, 0)))


def attention_loop(attention, steps: int, **kw):
  """A jitted loop of `steps` rounds (q, table, seq_ids, positions, *caches): each round
  attends over every cache in turn, each call's q taking its first element from the last
  output."""
  def run(q, table, seq_ids, positions, *caches):
    def body(_, q):
      for kv in caches:
        out = attention(q, kv, table, seq_ids, positions, **kw)
        first = out.reshape(-1)[:1].astype(q.dtype) * 1e-3
        q = lax.dynamic_update_slice(q, first.reshape((1,) * q.ndim), (0,) * q.ndim)
      return q
    return lax.fori_loop(0, steps, body, q)
  return jax.jit(run)


def inputs(cfg, case: Case, copies: int, seed: int = 0):
  """Random q [T, H, h] and `copies` caches [P, page_size, 2 K h] (keys, then values), bf16,
  as numpy (both variants start from the same values)."""
  rng = np.random.default_rng(seed)
  h, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
  q = rng.standard_normal((case.rows, heads, h), np.float32)
  caches = [rng.standard_normal((case.num_pages, case.page_size, 2 * kv * h), np.float32)
            for _ in range(copies)]
  return q, caches


def measure_ours(cfg, case: Case, window: int | None, q_np, caches_np, steps: int,
                 repeats: int, energy_s: float, options, settings=None):
  """Our times, energy and the first cache's output ([T, H, h] float32, for the
  comparison)."""
  attention, group = our_attention(cfg, case.rows, options, settings)
  kw = dict(window=window, softcap=cfg.attn_logit_softcap,
            scale=cfg.query_pre_attn_scalar**-0.5)
  q = grouped_query(jnp.asarray(q_np, jnp.bfloat16), group, cfg.num_kv_heads)
  caches = [jnp.asarray(c, jnp.bfloat16) for c in caches_np]
  args = (jnp.asarray(case.page_table), jnp.asarray(case.seq_ids), jnp.asarray(case.positions))
  out = jax.jit(functools.partial(attention, **kw))(q, caches[0], *args)
  f = attention_loop(attention, steps, **kw)
  call = lambda: jax.block_until_ready(f(q, *args, *caches))  # noqa: E731
  times = C.per_unit_us(call, repeats, steps * len(caches))  # after a first, compiling call
  extra = C.repeated_energy(call, energy_s, steps * len(caches), "layer")
  return times, extra, np.asarray(out, np.float32).reshape(case.rows, cfg.num_heads, -1)


def measure_vllm(cfg, case: Case, window: int | None, q_np, caches_np, steps: int,
                 repeats: int, energy_s: float):
  """vLLM's FlashAttention 3 on the same values: varlen queries by sequence run, each
  sequence's keys up to its last row through its block table, causal, vLLM's window
  (window - 1 keys back, none ahead); FA3's own split heuristics (num_splits 0), captured in
  a CUDA graph. Its times, energy and the first cache's output."""
  import torch
  from vllm.vllm_flash_attn import flash_attn_varlen_func
  dev = "cuda"
  h, kv = cfg.head_dim, cfg.num_kv_heads
  q = torch.from_numpy(q_np).to(dev, torch.bfloat16)
  caches = []
  for c in caches_np:
    t = torch.from_numpy(c).to(dev, torch.bfloat16)
    shape = (case.num_pages, case.page_size, kv, h)
    caches.append((t[..., :kv * h].reshape(shape).contiguous(),
                   t[..., kv * h:].reshape(shape).contiguous()))
  runs = case.runs()
  cu = np.concatenate([[0], np.cumsum([n for _, _, n in runs])]).astype(np.int32)
  used = np.array([int(case.positions[f + n - 1]) + 1 for _, f, n in runs], np.int32)
  table = case.page_table[[s for s, _, _ in runs]]
  meta = dict(cu_seqlens_q=torch.from_numpy(cu).to(dev), max_seqlen_q=int(np.diff(cu).max()),
              seqused_k=torch.from_numpy(used).to(dev), max_seqlen_k=int(used.max()),
              block_table=torch.from_numpy(np.ascontiguousarray(table)).to(dev),
              softmax_scale=cfg.query_pre_attn_scalar**-0.5, causal=True,
              window_size=[-1, -1] if window is None else [window - 1, 0],
              softcap=cfg.attn_logit_softcap or 0.0, fa_version=3, num_splits=0)
  out = torch.empty_like(q)
  flash_attn_varlen_func(q=q, k=caches[0][0], v=caches[0][1], out=out, **meta)
  first = out.float().cpu().numpy()

  def chain():
    for _ in range(steps):
      for k, v in caches:
        flash_attn_varlen_func(q=q, k=k, v=v, out=out, **meta)
        q[:1, :1, :1].copy_(out[:1, :1, :1] * 1e-3)

  call = C.torch_graph(chain)  # FA3's buffers before the capture
  times = C.per_unit_us(call, repeats, steps * len(caches))
  return times, C.repeated_energy(call, energy_s, steps * len(caches), "layer"), first


def measure(cfg, case: Case, layer: str, variant: str, steps: int, repeats: int,
            kv_mb: int = 0, energy_s: float = 0.0, against=None,
            options=None, config: str | None = None) -> tuple[dict, np.ndarray]:
  """One point: us per layer call (median of `repeats` loops), the K/V bytes the layer
  must read and the TB/s that makes, J per call; `against` (another variant's output on
  the same values) gives the largest difference between the two. options: our
  KernelOptions (default: KernelOptions()); config: ours with the step's kernel at other
  settings (a decode step's `decode_settings`, a mixed step's `prefill_settings`)."""
  if options is None:
    from blink_jax.engine_config import KernelOptions
    options = KernelOptions()
  window = None if layer == "global" else cfg.sliding_window
  row_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # a key and a value, bf16
  copies = copies_for(case, row_bytes, kv_mb)
  q, caches = inputs(cfg, case, copies)
  if variant == "ours":
    settings = config and (decode_settings if case.kind == "decode" else prefill_settings)(config)
    times, extra, out = measure_ours(cfg, case, window, q, caches, steps, repeats, energy_s,
                                     options, settings)
  else:
    times, extra, out = measure_vllm(cfg, case, window, q, caches, steps, repeats, energy_s)
  kv_bytes = case.keys_read(window) * row_bytes
  row = {"case": case.name, "kind": case.kind, "batch": case.n_seqs, "rows": case.rows,
         "context": case.context, "layer": layer, "window": window,
         "variant": variant if not config else f"{variant} {config}",
         "copies": copies, **C.stats(times, "us"), "kv_bytes": kv_bytes, **extra}
  row["kv_tb_per_s"] = kv_bytes / (row["us_median"] * 1e-6) / 1e12
  if against is not None:
    row["max_abs_diff"] = float(np.abs(out - against).max())
  return row, out


def layer_counts(cfg) -> dict[str, int]:
  """Sliding-window and global layers of the shape."""
  local = sum(cfg.window(i) is not None for i in range(cfg.num_layers))
  return {"local": local, "global": cfg.num_layers - local}


def main(argv):
  del argv
  # Both stacks in one process: XLA takes its memory as it goes, not 75 % of it at once.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  xla_flags.configure_command_buffers()  # before the backend starts
  bad = set(FLAGS.variants) - set(VARIANTS)
  if bad:
    raise app.UsageError(f"--variants: {sorted(bad)} not in {list(VARIANTS)}")
  if "vllm" in FLAGS.variants:
    sys.path.insert(0, FLAGS.vllm_path)
  cfg = tiny_config("gemma3") if FLAGS.config == "tiny" else get_config(FLAGS.config)
  print(f"device {C.describe_device()}, {cfg.name}", flush=True)
  cases = [Case("decode", int(b), FLAGS.context, page_size=FLAGS.page_size)
           for b in FLAGS.batches]
  for spec in FLAGS.mixed:
    t, _, d = spec.partition(":")
    cases.append(Case("mixed", int(d or 0), FLAGS.context, int(t), FLAGS.mixed_prompt,
                      FLAGS.page_size))
  counts = layer_counts(cfg)
  rows = []
  for case in cases:
    # ours first (the others' outputs are compared with it), then ours with its kernel at
    # each other setting (a decode step's decode kernel, a mixed step's prefill kernel),
    # then vLLM's.
    points = [(v, None) for v in FLAGS.variants if v == "ours"]
    if "ours" in FLAGS.variants:
      configs = FLAGS.decode_configs if case.kind == "decode" else FLAGS.prefill_configs
      points += [("ours", spec) for spec in configs]
    points += [(v, None) for v in FLAGS.variants if v != "ours"]
    per_step = {}
    for layer in ("local", "global"):
      ours = None
      for variant, config in points:
        name = variant if config is None else f"{variant} {config}"
        try:
          row, out = measure(cfg, case, layer, variant, FLAGS.steps, FLAGS.repeats,
                             FLAGS.kv_mb, FLAGS.energy_s, against=ours,
                             options=C.kernel_options(), config=config)
        except Exception as e:  # noqa: BLE001 - the peer's side fails alone, on the record
          if name == "ours":
            raise
          print(f"{case.name:12s} {layer:6s} {name:5s} failed: {e!r}", flush=True)
          rows.append({"case": case.name, "layer": layer, "variant": name, "error": repr(e)})
          continue
        ours = out if name == "ours" else ours
        rows.append(row)
        per_step[name] = per_step.get(name, 0.0) + counts[layer] * row["us_median"]
        print(f"{case.name:12s} {layer:6s} {name:5s} {row['us_median']:8.2f} us "
              f"[{row['us_min']:.2f}-{row['us_max']:.2f}] {row['kv_tb_per_s']:5.2f} TB/s of "
              f"{row['kv_bytes'] / 2**20:.1f} MiB"
              + (f", {1e6 * row['energy_above_idle_per_layer_j']:.1f} uJ above idle"
                 if "energy_above_idle_per_layer_j" in row else "")
              + (f", max |diff| {row['max_abs_diff']:.3g}" if "max_abs_diff" in row else ""),
              flush=True)
    print(f"{case.name:12s} a step's {cfg.num_layers} layers: " + ", ".join(
        f"{v} {us:.0f} us" for v, us in per_step.items()), flush=True)
  C.write_result(FLAGS.out, "attention", rows, {"config": cfg.name, "layers": counts,
                                               "kernels": C.kernels_record(
                                                   C.kernel_options(),
                                                   jax.devices()[0].platform)})


if __name__ == "__main__":
  define_flags()
  app.run(main)
