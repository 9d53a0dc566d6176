"""The executor: one XLA program that serves until the mailbox's shutdown word is set.

Persistent mode: `jax.jit` of a `lax.while_loop` whose body is blink_schedule (FFI) -> the
model step on the step's ragged batch (one `lax.switch` branch per token bucket, on a CPU one
0/1-trip while loop per bucket; an empty step runs no model) -> blink_commit (FFI). KV pages,
scheduler state, history and page tables are the loop carry (donated). On a GPU with the
command-buffer flags the loop becomes a CUDA graph with a device-side WHILE node: after launch
the host CPU does nothing.

Tensor parallelism: the same loop under `jax.shard_map` over a mesh of devices, the first
scheduling for all (docs/ARCHITECTURE.md, "Tensor parallelism (design)").

Host mode: the same step, jitted alone, driven by a Python loop that waits for every step (the
conventional design of JetStream and vLLM); the baseline every benchmark compares to.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from blink_jax.engine_config import KernelOptions
from blink_jax.executor import compilation_cache, xla_flags
from blink_jax.executor.loop_report import XLA_OP_BY_OP_LINE, capture_stderr, command_buffer_report
from blink_jax.kernels.select import step_kernels
from blink_jax.model.gemma import (Block, Gemma, init_kv_cache, kv_page_bytes,
                                    max_kv_pages, ring_bytes)
from blink_jax.model.sampling import sample, top_n_by_reductions
from blink_jax.model.tensor_parallel import TP_AXIS, TensorParallel
from blink_jax.native import batch, ffi

log = logging.getLogger("blink_jax.executor")


# Rows whose prompt logprobs one piece of a step computes at once. Their logits, its
# log-softmax and the top-n passes are float32 [rows, vocab] arrays (four of them live at
# once: 4 GiB at 1,024 rows of Gemma's 262,144-token vocabulary), and XLA allocates the
# largest branch's temporaries up front for the whole loop, so a 4,096-row bucket computing
# them in one piece held 16 GiB of every GPU back from the KV cache (`workspace_bytes`).
PROMPT_LOGPROB_ROWS = 512


@dataclasses.dataclass
class Carry:
  state: jax.Array       # scheduler state (int32 words, layout private to ffi/)
  history: jax.Array     # [max_seqs, max_context] token ids per lane
  page_table: jax.Array  # [max_seqs, max_pages_per_seq]
  kv: list               # per layer kv_pages (keys, then values)
  shutdown: jax.Array    # int32 scalar: the last schedule saw the shutdown word


jax.tree_util.register_dataclass(Carry, data_fields=["state", "history", "page_table", "kv",
                                                     "shutdown"], meta_fields=[])


# The FFI calls read and write the mailbox but are not marked side-effecting: every result is
# consumed by the next call, so data dependencies already order them (marking them made no
# difference on the H200; docs/PERFORMANCE.md, "Removed experiments").


def schedule_call(cfg: ffi.SchedConfig, state, history, page_table):
  out = (jax.ShapeDtypeStruct(state.shape, jnp.int32),
         jax.ShapeDtypeStruct(history.shape, jnp.int32),
         jax.ShapeDtypeStruct(page_table.shape, jnp.int32),
         jax.ShapeDtypeStruct((ffi.batch_words(cfg),), jnp.int32))
  return jax.ffi.ffi_call("blink_schedule", out, input_output_aliases={0: 0, 1: 1, 2: 2})(
      state, history, page_table, **cfg.attrs())


def commit_call(cfg: ffi.SchedConfig, state, history, page_table, words, sampled, logprobs,
                top_ids, top_lps, row_lps, row_top_ids, row_top_lps):
  """Per sample (max_seqs): token, logprob, top-n; per batch row (token_budget): the logprob
  and top-n of the row's prompt-logprob target (ffi/scheduler.h, BlinkStepOutputs)."""
  out = (jax.ShapeDtypeStruct(state.shape, jnp.int32),
         jax.ShapeDtypeStruct(history.shape, jnp.int32))
  return jax.ffi.ffi_call("blink_commit", out, input_output_aliases={0: 0, 1: 1})(
      state, history, page_table, words, sampled, logprobs, top_ids, top_lps, row_lps,
      row_top_ids, row_top_lps, **cfg.attrs())


class Executor:
  """Owns the device state and runs the serving loop over one mailbox."""

  def __init__(self, model: Gemma, sched: ffi.SchedConfig, *, max_top_logprobs: int,
               device: jax.Device | None = None, kernels: KernelOptions | None = None,
               tensor_parallel: int = 1, donate_model: bool = False):
    """kernels: the step's kernels (`KernelOptions`; "auto" resolved for this device, see
    `blink_jax.kernels.select`). tensor_parallel: the weights and KV cache split over that
    many devices of `device`'s platform, `device` first (docs/ARCHITECTURE.md, "Tensor
    parallelism (design)"); persistent mode only. donate_model: `model`'s arrays that the
    executor does not hold (the q/k/v and gate/up weights it keeps fused; with tensor
    parallelism every unsplit original) are deleted, so their memory counts for the KV
    cache; the model cannot run afterwards."""
    ffi.register_targets()
    self.cfg, self.dtype = model.cfg, model.dtype
    self.sched = sched
    self.max_top = max_top_logprobs
    self.device = device or jax.devices()[0]
    self.tp = TensorParallel(model.cfg, tensor_parallel) if tensor_parallel > 1 else None
    if self.tp is not None:
      devices = [self.device] + [d for d in jax.devices(self.device.platform)
                                 if d != self.device]
      if len(devices) < tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} needs that many "
                         f"{self.device.platform} devices; there are {len(devices)}"
                         + (" (XLA makes more CPU devices with XLA_FLAGS="
                            "--xla_force_host_platform_device_count=N, set before JAX starts)"
                            if self.device.platform == "cpu" else ""))
      self.mesh = jax.sharding.Mesh(np.array(devices[:tensor_parallel]), (TP_AXIS,))
    # The one place the executor picks its form: on a GPU lax.switch branches, a cache in the
    # model's dtype, Pallas/CUDA kernels and the whole output layer every step; elsewhere the
    # forms XLA's CPU runtime runs well (docs/ARCHITECTURE.md, "The persistent loop").
    self.on_gpu = self.device.platform == "gpu"
    asked = kernels or KernelOptions()
    self.kernels = asked.resolved(self.device.platform, sched.max_seqs)
    # Kernel families "auto" put on Pallas: if they fail to compile, `compile` falls back.
    self._auto_pallas = tuple(kind for kind in ("attention", "prefill", "norm")
                              if getattr(asked, kind) == "auto"
                              and getattr(self.kernels, kind) == "pallas")
    # The weights travel as a flat tuple of arrays: jax dispatches a tuple of ~350 arrays in
    # ~70 us, the same leaves inside nnx.State objects in ~300 us (measured on CPU), a cost
    # host mode pays every step. Traced code rebuilds the State (`_model`).
    if self.tp is None:
      self.graphdef, params = nnx.split(model)
      leaves, self._params_def = jax.tree.flatten(params)
      self.params = tuple(jax.device_put(leaves, self.device))
    else:  # the model traced code sees is one device's shard (tensor_parallel.py)
      self.graphdef, params = self.tp.split_model(model, self.mesh)
      leaves, self._params_def = jax.tree.flatten(params)
      self.params = tuple(leaves)
    # Each layer's q/k/v and gate/up weights side by side, made once: a step that made them
    # would copy them every step in host mode (the loop hoists such a copy; a step cannot).
    fused = lambda p: tuple(self._model(p).fused_weights())  # noqa: E731
    if self.tp is not None:
      fused = jax.shard_map(fused, mesh=self.mesh, in_specs=(self._param_specs,),
                            out_specs=P(None, TP_AXIS), check_vma=False)
    self.fused = jax.jit(fused)(self.params)
    self._drop_fused_away(model, donate_model)
    # Zero outputs for empty steps and requests without logprobs, made once: a zero-fill
    # inside the loop would be a memset, which XLA cannot capture into a CUDA graph.
    n, k, r = sched.max_seqs, max_top_logprobs, sched.token_budget
    self.zeros = jax.device_put((np.zeros((n,), np.int32), np.zeros((n,), np.float32),
                                 np.zeros((n, k), np.int32), np.zeros((n, k), np.float32),
                                 np.zeros((r,), np.float32), np.zeros((r, k), np.int32),
                                 np.zeros((r, k), np.float32)),
                                self.device if self.tp is None else self._replicated)
    if self.tp is not None:  # what a follower's skipped schedule returns (no memset in the loop)
      self.zero_words = jax.device_put(np.zeros((ffi.batch_words(sched),), np.int32),
                                       self._replicated)
    self._make_jits()

  def _drop_fused_away(self, model: Gemma, donate: bool) -> None:
    """Replaces the weights the fused copies hold (`Block.FUSED_AWAY`) by empty placeholders
    in the loop's inputs: each was kept twice, 0.9 of the 1B's 2.0 GB of weights again and
    34 of the 27B's 54 GB (docs/ARCHITECTURE.md, "Parameter tree"). donate: then deletes the
    model's arrays whose buffers the executor does not hold."""
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(self._params_def, self.params))[0]
    names = [tuple(getattr(k, "key", getattr(k, "name", k)) for k in path) for path, _ in paths]
    away = [len(n) >= 3 and n[-3:-1] in Block.FUSED_AWAY for n in names]
    where = self.device if self.tp is None else self._replicated
    self.params = tuple(jax.device_put(jnp.zeros((0,), a.dtype), where) if gone else a
                        for a, gone in zip(self.params, away))
    if donate:
      held = {s.data.unsafe_buffer_pointer() for a in jax.tree.leaves((self.params, self.fused))
              for s in a.addressable_shards}
      for a in jax.tree.leaves(nnx.state(model, nnx.Param)):
        if isinstance(a, jax.Array) and not a.is_deleted() and held.isdisjoint(
            s.data.unsafe_buffer_pointer() for s in a.addressable_shards):
          a.delete()

  def _make_jits(self):
    """The jitted step and loop. Fresh partials each time: jax caches traces by function,
    and a bound method compares equal to itself, so re-jitting one after the kernel choice
    changed would reuse the old trace.
    keep_unused: a carry field a step does not read (its shutdown word) would be pruned from
    its inputs, and its output would get a fresh buffer every step; a CUDA graph that touches
    a moved buffer is re-recorded before it runs. Kept, every carry output aliases its
    donated input and the addresses stay put."""
    self._step = jax.jit(functools.partial(Executor._step_fn, self), donate_argnums=(1,),
                         keep_unused=True)
    self._loop = jax.jit(functools.partial(Executor._loop_fn, self), donate_argnums=(1,),
                         keep_unused=True)

  @property
  def devices(self) -> list[jax.Device]:
    """The devices the loop runs on: `device`, or the tensor-parallel mesh's, leader first."""
    return [self.device] if self.tp is None else list(self.mesh.devices.flat)

  @property
  def _replicated(self) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(self.mesh, P())

  @property
  def _param_specs(self) -> tuple:
    return tuple(a.sharding.spec for a in self.params)

  def _model(self, params: tuple) -> Gemma:
    """The model over the flat weight tuple (inside traced code)."""
    return nnx.merge(self.graphdef, jax.tree.unflatten(self._params_def, params))

  @property
  def inputs(self):
    """The loop's read-only inputs: weights, the zero outputs, the fused weights and, with
    tensor parallelism, the followers' zero batch words."""
    base = (self.params, self.zeros, self.fused)
    return base if self.tp is None else (*base, self.zero_words)

  # ---- state ----
  @property
  def kv_dtype(self):
    """The KV cache's dtype: the model's, but float32 off the GPU. XLA's CPU backend gathers
    and scatters 16-bit floats through float32 copies of the whole cache, every layer and
    step (a bfloat16 token of the 270M cost 290 instead of 60 ms); a float32 cache holds the
    same values, since the rows written are rounded to the model's dtype first."""
    return self.dtype if self.on_gpu else jnp.float32

  @property
  def _device_cfg(self):
    """The model config one device holds (its shard's, with tensor parallelism)."""
    return self.cfg if self.tp is None else self.tp.local_config()

  @property
  def page_bytes(self) -> int:
    """Device bytes of one KV page on one device (every layer's keys and values, in
    `kv_dtype`; with windowed pages the global layers'; with tensor parallelism its heads')."""
    return kv_page_bytes(self._device_cfg, self.sched.page_size, self.kv_dtype,
                         windowed=self.sched.window > 0)

  @property
  def max_pages(self) -> int:
    """The most KV pages this executor's cache may have (`gemma.max_kv_pages`)."""
    return max_kv_pages(self._device_cfg, self.sched.page_size)

  @property
  def ring_pages(self) -> int:
    """Pages of the sliding-window layers' rings, all lanes together (0: not windowed)."""
    return self.sched.max_seqs * self.sched.window_pages if self.sched.window > 0 else 0

  @property
  def ring_bytes(self) -> int:
    """Device bytes of those rings (fixed by max_seqs, whatever the page count)."""
    return ring_bytes(self._device_cfg, self.sched.page_size, self.ring_pages, self.kv_dtype)

  @property
  def workspace_bytes(self) -> int:
    """What a GPU's KV cache leaves free for the step's temporaries: a conservative reserve,
    since the compiled loop's own figure (`memory_analysis`) exists only after the compile,
    which needs the page count. The largest temporaries are float32 [logit_rows, vocab]
    arrays (prompt logprobs: the logits of a piece of the rows, their log-softmax, the top-n
    passes; the sampler's over the samples): four are reserved, plus 512 MiB for the
    activations, the carry's history and page table and XLA's scratch. For Gemma 3 1B
    (vocab 262,144) at 256 sequences and a 4,096-token budget that is 2.5 GiB (16.5 before
    the prompt logprobs came in pieces). The engine checks the compiled loop against it."""
    return 4 * self.logit_rows * self.cfg.vocab_size * 4 + (512 << 20)

  @property
  def logit_rows(self) -> int:
    """The most rows a step holds float32 logits of at once: its samples (at most max_seqs)
    or a piece of its prompt-logprob rows (PROMPT_LOGPROB_ROWS)."""
    s = self.sched
    return min(s.token_budget, max(s.max_seqs, PROMPT_LOGPROB_ROWS))

  def set_num_pages(self, num_pages: int) -> None:
    """The KV cache's page count, set before `initial_carry` and `compile` (the engine sizes
    a GPU's cache from the memory left once __init__ has put the weights there)."""
    self.sched = self.sched.replace(num_pages=num_pages)

  def initial_carry(self) -> Carry:
    s = self.sched
    state = ffi.initial_state(s)
    history = np.zeros((s.max_seqs, s.max_context), np.int32)
    page_table = np.zeros((s.max_seqs, s.max_pages_per_seq), np.int32)
    if self.tp is not None:
      # Scheduler state, history and page table: one row per device, only the leader's used
      # (docs/ARCHITECTURE.md, "Tensor parallelism (design)").
      lead = jax.sharding.NamedSharding(self.mesh, P(TP_AXIS))
      def per_device(a):
        return jax.device_put(np.broadcast_to(a, (self.tp.n, *a.shape)), lead)
      return Carry(
          state=per_device(state), history=per_device(history),
          page_table=per_device(page_table),
          kv=self.tp.init_kv_cache(self.mesh, s.num_pages, s.page_size, self.kv_dtype,
                                   ring_pages=self.ring_pages),
          shutdown=jax.device_put(np.zeros((), np.int32), self._replicated))
    with jax.default_device(self.device):
      return Carry(
          state=jnp.asarray(state), history=jnp.asarray(history),
          page_table=jnp.asarray(page_table),
          kv=init_kv_cache(self.cfg, s.num_pages, s.page_size, self.kv_dtype,
                           ring_pages=self.ring_pages),
          shutdown=jnp.zeros((), jnp.int32))

  # ---- one step ----
  def _bucket_branch(self, rows: int):
    s, max_top = self.sched, self.max_top
    samples = min(rows, s.max_seqs)

    def run(params, words, page_table, kv):
      params, zeros, fused = params[:3]
      model = self._model(params)
      b = batch.split(words, s.token_budget, s.max_seqs, rows, samples)
      kernels = step_kernels(model.cfg, self.kernels, rows, interpret=not self.on_gpu)
      hidden, kv = model.forward(b.tokens, b.positions, b.seq_ids, page_table, kv, kernels,
                                 fused=fused, window_pages=s.window_pages if s.window else 0,
                                 local_only=b.local_only)
      h = hidden[jnp.clip(b.rows, 0, rows - 1)]
      f32 = lambda bits: lax.bitcast_convert_type(bits, jnp.float32)  # noqa: E731

      if self.on_gpu or samples == 1:
        logits = model.logits(h, kernels.logits)
      else:
        # Off the GPU a step with one sample (a prompt's last chunk alone, the usual prefill)
        # computes the output layer for one row: it is a CPU's largest matmul (the 270M in
        # float32: 26 ms at one row, 48 at eight). On a GPU it reads the same weights at any
        # row count. The rows past the step's samples are zeros, and the commit reads none.
        logits = lax.cond(
            words[batch.NUM_SAMPLES] <= 1,
            lambda: jnp.pad(model.logits(h[:1], kernels.logits), ((0, samples - 1), (0, 0))),
            lambda: model.logits(h, kernels.logits))
      tok, lp, tid, tlp = sample(logits, f32(b.temperature), f32(b.top_p), b.top_k, b.seed_lo,
                                 b.seed_hi, b.position, b.num_logprobs,
                                 (zeros[1][:samples], zeros[2][:samples], zeros[3][:samples]),
                                 max_top=max_top, thresholds=kernels.thresholds)
      pad = s.max_seqs - samples
      rlp, rid, rtl = self._prompt_logprobs(model, kernels, hidden, b.targets, zeros[4:], rows)
      rpad = s.token_budget - rows
      return (jnp.pad(tok, (0, pad)), jnp.pad(lp, (0, pad)), jnp.pad(tid, ((0, pad), (0, 0))),
              jnp.pad(tlp, ((0, pad), (0, 0))), jnp.pad(rlp, (0, rpad)),
              jnp.pad(rid, ((0, rpad), (0, 0))), jnp.pad(rtl, ((0, rpad), (0, 0))), kv)

    return run

  def _prompt_logprobs(self, model, kernels, hidden, targets, zeros, rows: int):
    """Logprob (and top-n) of each row's target token under the model; only computed when
    some row has a target (a request asked for prompt logprobs): logits of every row, in
    pieces of PROMPT_LOGPROB_ROWS, one after the other."""
    max_top = self.max_top

    def piece(h, t):
      # Every result is a reduction over the piece's logits, so no fusion of the
      # concatenation below reaches back into them and keeps every piece's alive.
      lp = jax.nn.log_softmax(model.logits(h, kernels.logits), axis=-1)
      cols = jnp.arange(lp.shape[-1], dtype=jnp.int32)[None, :]
      chosen = jnp.sum(jnp.where(cols == jnp.maximum(t, 0)[:, None], lp, 0.0), axis=-1)
      top_lp, top_id = top_n_by_reductions(lp, max(max_top, 1))
      if max_top == 0:
        return chosen, zeros[1][:h.shape[0]], zeros[2][:h.shape[0]], top_id[:, 0]
      return chosen, top_id, top_lp, top_id[:, 0]

    def compute():
      # Not a lax.map: its scan's memset keeps the loop out of a CUDA graph. A piece starts
      # from the last one's results (its first ids, never negative), so the two cannot run
      # side by side and share their temporaries: an optimization barrier did not do that
      # on XLA's CPU, whose thunks run concurrently where no data orders them.
      outs = []
      for i in range(0, rows, PROMPT_LOGPROB_ROWS):
        h = hidden[i:i + PROMPT_LOGPROB_ROWS]
        if outs:
          h = jnp.where(jnp.min(outs[-1][3]) >= 0, h, jnp.zeros_like(h))
        outs.append(piece(h, targets[i:i + PROMPT_LOGPROB_ROWS]))
      return tuple(jnp.concatenate(parts) for parts in list(zip(*outs))[:3])

    return lax.cond(jnp.any(targets >= 0), compute,
                    lambda: (zeros[0][:rows], zeros[1][:rows], zeros[2][:rows]))

  def _empty_branch(self, params, words, page_table, kv):
    return (*params[1], kv)

  def _select_branch(self, index, branches, params, words, page_table, kv):
    """Runs `branches[index]`. On a GPU a `lax.switch` (a conditional node of the CUDA graph,
    updating the cache in place). XLA's CPU runtime gives a conditional's operands and results
    separate buffers, so there a switch copied every layer's cache, even in the empty branch
    of an idle step: instead each bucket branch is a `lax.while_loop` that runs 0 or 1 times,
    whose carry is one buffer (docs/NOTES.md, "Whole-cache copies on the CPU backend")."""
    if self.on_gpu:
      return lax.switch(index, branches, params, words, page_table, kv)
    outs = tuple(branches[0](params, words, page_table, kv)[:-1])
    # The barrier ties the batch (words, page table) to the loop-variant cache: without it XLA
    # hoists what depends only on the batch (the embedding gather, the first layer's QKV
    # projection and RoPE) out of every loop, and each step ran that for every bucket.
    for i, branch in enumerate(branches[1:], start=1):
      def body(c, branch=branch):
        _, _, kv = c
        w, pt, kv = lax.optimization_barrier((words, page_table, kv))
        *outs, kv = branch(params, w, pt, kv)
        return jnp.int32(1), tuple(outs), kv
      _, outs, kv = lax.while_loop(lambda c, i=i: (c[0] == 0) & (index == i), body,
                                   (jnp.int32(0), outs, kv))
    return (*outs, kv)

  def _step_fn(self, params, c: Carry) -> Carry:
    s = self.sched
    if self.tp is None:
      state, history, page_table, words = schedule_call(s, c.state, c.history, c.page_table)
    else:
      # One scheduling decision (docs/ARCHITECTURE.md, "Tensor parallelism (design)"): only
      # the leader reads the mailbox and schedules; its batch words and page table reach
      # every device by a sum with zeros, so every device runs the same branch on the same
      # batch, whatever the frontend writes meanwhile.
      lead = lax.axis_index(TP_AXIS) == 0
      state, history, page_table, words = lax.cond(
          lead, lambda: schedule_call(s, c.state, c.history, c.page_table),
          lambda: (c.state, c.history, c.page_table, params[3]))
      words = lax.psum(words, TP_AXIS)
      page_table = lax.psum(jnp.where(lead, page_table, 0), TP_AXIS)
    branches = [self._empty_branch] + [self._bucket_branch(r) for r in s.buckets]
    *outs, kv = self._select_branch(words[batch.BUCKET] + 1, branches, params, words,
                                    page_table, c.kv)
    if self.tp is None:
      state, history = commit_call(s, state, history, page_table, words, *outs)
    else:  # every device sampled the same tokens from the same gathered logits
      state, history = lax.cond(
          lead, lambda: commit_call(s, state, history, page_table, words, *outs),
          lambda: (state, history))
    return Carry(state, history, page_table, kv, words[batch.SHUTDOWN])

  def _loop_fn(self, params, c: Carry) -> Carry:
    loop = lambda params, c: lax.while_loop(  # noqa: E731
        lambda c: c.shutdown == 0, lambda c: self._step_fn(params, c), c)
    if self.tp is None:
      return loop(params, c)

    def per_device(params, c):  # this device's rows of the leader-only carry fields
      c = loop(params, Carry(c.state[0], c.history[0], c.page_table[0], c.kv, c.shutdown))
      return Carry(c.state[None], c.history[None], c.page_table[None], c.kv, c.shutdown)
    rows = P(TP_AXIS)
    carry_specs = Carry(rows, rows, rows, [self.tp.kv_spec()] * len(c.kv), P())
    input_specs = (self._param_specs, jax.tree.map(lambda _: P(), self.zeros),
                   jax.tree.map(lambda _: P(None, TP_AXIS), self.fused), P())
    return jax.shard_map(per_device, mesh=self.mesh, in_specs=(input_specs, carry_specs),
                         out_specs=carry_specs, check_vma=False)(params, c)

  # ---- drivers ----
  def compile(self, carry: Carry, mode: str):
    """AOT-compiles the loop (persistent) or the step (host); returns the compiled object.
    Kernel families that "auto" put on Pallas fall back to the jnp reference, loudly, when
    they do not compile (Triton's limits differ between GPUs); asked for by name, the error
    stands."""
    try:
      return self._compile(carry, mode)
    except Exception as e:  # noqa: BLE001 - Triton and XLA report through several types
      if not self._auto_pallas:
        raise
      log.warning("the Pallas kernels for %s did not compile on %s (%s: %s); falling back to "
                  "the jnp reference", " and ".join(self._auto_pallas), self.device,
                  type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
      self.kernels = self.kernels.without_pallas(self._auto_pallas)
      self._auto_pallas = ()
      self._make_jits()
      return self._compile(carry, mode)

  def _compile(self, carry: Carry, mode: str):
    fn = self._loop if mode == "persistent" else self._step
    if self.tp is not None and mode != "persistent":
      raise ValueError("tensor_parallel runs the persistent loop only (mode='persistent')")
    t0 = time.perf_counter()
    lowered = fn.lower(self.inputs, carry)
    options = {}
    if mode == "host" and self.on_gpu:
      options.update(xla_flags.host_options())
    # A loop loaded from JAX's compilation cache comes without XLA's compile log, which the
    # loop report reads on a GPU: the report of the compile that filled the cache is kept.
    folder = compilation_cache.active_dir() if self.on_gpu else None
    key = compilation_cache.program_key(lowered.as_text(), self.device) if folder else None
    with capture_stderr() as log_text:
      compiled = lowered.compile(compiler_options=options or None)
    self.compile_log = log_text()
    self.loop_report = command_buffer_report(compiled, self.compile_log, self.device, mode)
    if key and self.loop_report.get("device_while") is None:
      self.loop_report = compilation_cache.load_report(folder, key) or self.loop_report
    elif key:
      compilation_cache.save_report(folder, key, self.loop_report)
    log.info("compiled %s %s in %.1f s", mode, "loop" if mode == "persistent" else "step",
             time.perf_counter() - t0)
    return compiled

  def warm_up(self, carry: Carry, compiled, mode: str, set_shutdown, workload=None) -> Carry:
    """Runs the serving loop once before serving and returns the carry for the real run.

    XLA executes a command buffer op by op the first time it runs (its warm-up: the host
    drives every iteration of the while loop) and only launches the CUDA graph from the
    second execution on; a serving loop executes once, so without this run it would stay
    host-driven. `workload(loop_alive)` runs while this first execution does (requests that
    take every bucket branch: host mode graphs each branch on its own, and each graph's
    first run is op by op too); then `set_shutdown(True)` ends it. Without a workload the
    loop exits at its first schedule, which is all the persistent loop needs (measured:
    docs/ARCHITECTURE.md, "CUDA-graph rules"). Nothing may be compiled between this run and serving."""
    run = self.run_persistent if mode == "persistent" else self.run_host
    # Made now, not after the run: creating any new XLA executable (even this zeros_like)
    # evicts every CUDA graph XLA holds, and the serving run would be a first execution again.
    running = jnp.zeros_like(carry.shutdown, device=carry.shutdown.sharding)
    out: dict = {}

    def first_execution():
      try:
        out["carry"] = run(carry, compiled)
      except BaseException as e:  # re-raised below, in the caller's thread
        out["error"] = e

    with capture_stderr() as log_text:
      try:
        if workload is None:
          set_shutdown(True)
          first_execution()
        else:
          t = threading.Thread(target=first_execution, name="blink-warm-up", daemon=True)
          t.start()
          try:
            workload(lambda: t.is_alive())
          finally:
            set_shutdown(True)
            t.join()
      finally:
        set_shutdown(False)
    if "error" in out:
      raise out["error"]
    if XLA_OP_BY_OP_LINE in log_text():
      self.loop_report = dict(self.loop_report, warm_up="XLA ran its op-by-op warm-up execution")
    return dataclasses.replace(out["carry"], shutdown=running)

  def run_persistent(self, carry: Carry, compiled=None) -> Carry:
    """Runs until the shutdown word is set; returns the final carry."""
    fn = compiled or self._loop
    return jax.block_until_ready(fn(self.inputs, carry))

  def run_host(self, carry: Carry, compiled=None, on_step=None) -> Carry:
    """Host-driven: Python launches every step and waits for it (the conventional design)."""
    fn = compiled or self._step
    while True:
      carry = fn(self.inputs, carry)
      if int(carry.shutdown):  # waits for the step, as serving loops that read tokens do
        return carry
      if on_step is not None:
        on_step(carry)
