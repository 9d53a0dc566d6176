"""Which kernels a serving step runs: the functions `Gemma.forward` takes (attention, q/k
preparation, add + norm, down projection) for a step of a given size, from the kernel kinds
the engine resolved (`config.resolve_kernel`) and the switches of experimental kernels."""
from __future__ import annotations

import functools

from blink_jax import (cuda_gemv, pallas_attention, pallas_ffw, pallas_norm, pallas_out,
                       pallas_prefill)
from blink_jax.model import add_rms_norm


def experimental_kernels() -> list[str]:
  """The non-default kernels switched on by environment variables."""
  return [name for name, on in (("BLINK_PALLAS_PREFILL", pallas_prefill.ENABLED),
                                ("BLINK_PALLAS_FFW", pallas_ffw.ENABLED),
                                ("BLINK_PALLAS_OUT", pallas_out.ENABLED),
                                ("BLINK_CUDA_GEMV", not cuda_gemv.AUTO and cuda_gemv.ENABLED),
                                ("BLINK_GEMV_QKV_PARTIALS", cuda_gemv.QKV_PARTIALS)) if on]


def step_kernels(cfg, attention: str, norm: str, rows: int, *, interpret: bool) -> dict:
  """`Gemma.forward`'s kernel functions for a step of `rows` tokens, given the resolved
  kinds (`config.resolve_kernel`). A Pallas kernel is compiled by Triton on the GPU and run
  by Pallas' interpreter elsewhere (interpret: the engine's device decides, so a CPU engine
  on a GPU machine interprets). With both kinds "pallas" the q/k kernel hands the attention
  its query grouped by KV head and padded; BLINK_CUDA_GEMV runs the chosen projections of
  steps of up to 8 tokens as the CUDA GEMV (`cuda_gemv`; the output and down projections
  only with norm "pallas", whose add + norm kernel sums their partials); else, with norm
  "pallas", BLINK_PALLAS_FFW=1 runs their down projection as the fused Pallas kernel
  (`pallas_ffw`), and with both "pallas" BLINK_PALLAS_OUT=1 merges the attention's splits
  inside the output projection (`pallas_out`)."""
  attention_fn = pallas_attention.select(attention, rows, interpret=interpret)
  group = cfg.num_heads // cfg.num_kv_heads
  grouped = norm == "pallas" and pallas_attention.uses_kernel(attention, rows)
  if grouped:
    attention_fn = functools.partial(attention_fn, group=group)
  prepare_fn = pallas_norm.select_prepare(
      norm, query_rows=pallas_attention.query_rows(group) if grouped else None,
      interpret=interpret)
  add_norm_fn = pallas_norm.select(norm, cfg.d_model, interpret=interpret)
  # The fused down projection and the merge + output projection hand partial sums to the
  # add + norm kernel, which adds them up.
  sums_partials = norm == "pallas" and add_norm_fn is not add_rms_norm
  ffw_down_fn = out_fn = gate_up_fn = qkv_fn = None
  gemv = cuda_gemv.active(interpret)
  gemv_fn = lambda f: functools.partial(f, use_kernel=not interpret)  # noqa: E731
  width, heads = cfg.d_model, cfg.num_heads * cfg.head_dim
  qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  if "qkv" in gemv and cuda_gemv.usable(rows, width, qkv_width):
    # Partial sums for the Pallas q/k prepare kernel to add up, or added up by XLA.
    partials = norm == "pallas" and cuda_gemv.QKV_PARTIALS
    qkv_fn = gemv_fn(cuda_gemv.partials if partials else cuda_gemv.matmul)
  if "gate_up" in gemv and cuda_gemv.usable(rows, width, 2 * cfg.ffw_hidden):
    gate_up_fn = gemv_fn(cuda_gemv.matmul)
  if sums_partials and "down" in gemv and cuda_gemv.usable(rows, cfg.ffw_hidden, width):
    ffw_down_fn = gemv_fn(cuda_gemv.ffw_down)
  elif sums_partials and pallas_ffw.ENABLED and pallas_ffw.usable(rows, cfg.ffw_hidden,
                                                                  width):
    ffw_down_fn = functools.partial(pallas_ffw.ffw_down, interpret=interpret)
  if sums_partials and "out" in gemv and cuda_gemv.usable(rows, heads, width):
    out_fn = gemv_fn(cuda_gemv.out_project)
  elif (sums_partials and grouped and pallas_out.ENABLED
        and pallas_out.usable(rows, cfg.num_heads, cfg.head_dim, width)):
    attention_fn = functools.partial(attention_fn, merged=False)
    out_fn = functools.partial(pallas_out.merge_out_project, group=group, interpret=interpret)
  return dict(attention_fn=attention_fn, prepare_fn=prepare_fn, add_norm_fn=add_norm_fn,
              ffw_down_fn=ffw_down_fn, out_fn=out_fn, gate_up_fn=gate_up_fn, qkv_fn=qkv_fn)
