"""Which kernels a serving step runs: the `StepKernels` that `Gemma.forward` takes, for a step
of a given size, from the engine's resolved `KernelOptions` (docs/ARCHITECTURE.md, "Kernels").

The one place that knows how the fast kernels fit together:
- decode-sized steps (up to `decode_rows` tokens) run the Pallas decode attention; with the
  Pallas norm kernels too, the q/k prepare kernel hands it the query already grouped by KV
  head and padded;
- larger steps run the Pallas prefill attention when `prefill` is "pallas"; with the Pallas
  decode attention too, their leading decode rows (where the scheduler puts them), at most
  `decode_head`, go to the decode kernel (`head_then_rest`);
- "blocked" (the CPU's default for both) runs `blocked_attention`, which reads only the key
  blocks up to the step's context; "reference" the oracle, which reads every whole page table;
- the CUDA GEMV runs the named projections of one-token steps; the output and down
  projections only with the Pallas add + norm kernel, which adds up their partial sums (and
  the q/k prepare kernel those of the q/k/v projection); with `split_matmul` the q/k/v,
  output and down projections of GPU steps of 2 to `decode_rows` tokens are XLA matmuls
  over slices of K whose partial sums those kernels add up too (`split_matmul`);
- off the GPU every other projection and the output layer run `cpu_matmul`'s matmuls (the
  form XLA's CPU backend runs fast in bfloat16; the plain matmul in float32);
- on the GPU a step finds its top-k / top-p thresholds with `cuda_sampler`'s radix
  selection (3 passes over the logits); off it the sampler bisects (32).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from blink_jax.engine_config import KernelOptions
from blink_jax.kernels import (blocked_attention, cpu_matmul, cuda_gemv, cuda_sampler,
                               pallas_attention, pallas_norm, pallas_prefill, split_matmul)
from blink_jax.model.gemma import StepKernels


def leading_single_rows(seq_ids, limit: int):
  """How many of the first `limit` rows each hold a sequence's only token of the step: a
  step's decode rows, which come first (a one-token prompt chunk among them counts too)."""
  seq = jnp.asarray(seq_ids, jnp.int32)[:limit + 1]
  before = jnp.concatenate([jnp.full((1,), -2, jnp.int32), seq[:-1]])
  after = jnp.concatenate([seq[1:], jnp.full((1,), -2, jnp.int32)])
  single = ((seq >= 0) & (seq != before) & (seq != after))[:limit]
  return jnp.sum(jnp.cumprod(single.astype(jnp.int32)))


def head_then_rest(q, kv_pages, page_table, seq_ids, positions, *, head: int, head_fn, rest_fn,
                   **kw):
  """Paged attention of a step's leading single-token rows (its decode rows, at most `head`
  of them) by head_fn and of the others by rest_fn (the same arguments and result,
  `attention.paged_attention_reference`'s). Every row attends to its own sequence's cached
  keys, so any split is exact; the split point is found at run time, and each kernel sees
  the other's rows as padding (sequence -1: no pages read). A step of at most `head` rows
  goes to head_fn whole (a second kernel would cost more than it saves there)."""
  rows = q.shape[0]
  if head >= rows:
    return head_fn(q, kv_pages, page_table, seq_ids, positions, **kw)
  seq = jnp.asarray(seq_ids, jnp.int32)
  in_head = jnp.arange(rows) < leading_single_rows(seq, head)
  first = head_fn(q[:head], kv_pages, page_table, jnp.where(in_head[:head], seq[:head], -1),
                  positions[:head], **kw)
  rest = rest_fn(q, kv_pages, page_table, jnp.where(in_head, -1, seq), positions, **kw)
  first = jnp.pad(first, ((0, rows - head),) + ((0, 0),) * (first.ndim - 1))
  return jnp.where(in_head.reshape((rows,) + (1,) * (first.ndim - 1)), first,
                   rest.astype(first.dtype))


def step_kernels(cfg, options: KernelOptions, rows: int, *, interpret: bool) -> StepKernels:
  """The kernels of a step of `rows` tokens. `options` must be resolved
  (`KernelOptions.resolved`: no "auto" left). A Pallas kernel is compiled by Triton on the GPU
  and run by Pallas' interpreter elsewhere (interpret: the engine's device decides, so a CPU
  engine on a GPU machine interprets); the CUDA GEMV runs its jnp stand-in where it
  interprets."""
  if ("auto" in (options.attention, options.prefill, options.norm, options.gemv)
      or options.decode_head is None):
    raise ValueError(f"step_kernels takes resolved KernelOptions, got {options}")
  group = cfg.num_heads // cfg.num_kv_heads
  decode = rows <= options.decode_rows
  pallas_norms = options.norm == "pallas"
  kernels = {}
  if decode and options.attention == "pallas":
    attention = functools.partial(pallas_attention.paged_decode_attention, interpret=interpret)
    if pallas_norms:  # the prepare kernel writes the grouped, padded query
      kernels["attention"] = functools.partial(attention, group=group)
      kernels["prepare"] = functools.partial(pallas_norm.prepare_qkv,
                                             query_rows=pallas_attention.query_rows(group),
                                             interpret=interpret)
    else:
      kernels["attention"] = attention
  elif not decode and options.prefill == "pallas":
    prefill = functools.partial(pallas_prefill.paged_prefill_attention, interpret=interpret)
    head = min(rows, options.decode_head) if options.attention == "pallas" else 0
    kernels["attention"] = prefill if not head else functools.partial(
        head_then_rest, head=head, rest_fn=prefill,
        head_fn=functools.partial(pallas_attention.paged_decode_attention, interpret=interpret))
  elif (options.attention if decode else options.prefill) == "blocked":
    kernels["attention"] = blocked_attention.paged_attention_blocked
  if pallas_norms and "prepare" not in kernels:
    kernels["prepare"] = functools.partial(pallas_norm.prepare_qkv, interpret=interpret)
  sums_partials = pallas_norms and pallas_norm.usable(cfg.d_model)
  if sums_partials:
    kernels["add_norm"] = functools.partial(pallas_norm.add_rms_norm, interpret=interpret)

  gemv = options.gemv_projections("gpu")  # resolved: the names as given
  width, heads = cfg.d_model, cfg.num_heads * cfg.head_dim
  qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  use = lambda f: functools.partial(f, use_kernel=not interpret)  # noqa: E731
  if "qkv" in gemv and cuda_gemv.usable(rows, width, qkv_width):
    # The Pallas prepare kernel adds up the partial sums itself: no XLA kernel between.
    kernels["qkv_matmul"] = use(cuda_gemv.partials if pallas_norms else cuda_gemv.matmul)
  if "gate_up" in gemv and cuda_gemv.usable(rows, width, 2 * cfg.ffw_hidden):
    kernels["gate_up_matmul"] = use(cuda_gemv.matmul)
  if sums_partials and "down" in gemv and cuda_gemv.usable(rows, cfg.ffw_hidden, width):
    kernels["ffw_down"] = use(cuda_gemv.ffw_down)
  if sums_partials and "out" in gemv and cuda_gemv.usable(rows, heads, width):
    kernels["out_project"] = use(cuda_gemv.out_project)
  if (options.split_matmul and sums_partials and not interpret
      and 1 < rows <= options.decode_rows):
    # XLA's GEMMs, split here so that the prepare and add + norm kernels add up the slices
    # instead of a split-K reduction kernel of XLA's (split_matmul).
    kernels.setdefault("qkv_matmul", split_matmul.partials)
    kernels.setdefault("out_project", split_matmul.out_project)
    kernels.setdefault("ffw_down", split_matmul.ffw_down)
  if not interpret:
    kernels["thresholds"] = use(cuda_sampler.thresholds)
  else:  # not on a GPU
    kernels.setdefault("qkv_matmul", cpu_matmul.matmul)
    kernels.setdefault("gate_up_matmul", cpu_matmul.matmul)
    kernels.setdefault("out_project", cpu_matmul.out_project)
    kernels.setdefault("ffw_down", cpu_matmul.ffw_down)
    kernels["logits"] = cpu_matmul.logits
  return StepKernels(**kernels)
