"""Drives blink_schedule / blink_commit through XLA (jax.ffi) on a given device, with the same
interface as tests.host_scheduler.HostScheduler, so the scheduler harness can run on any backend."""
from __future__ import annotations

import jax
import numpy as np

from blink_jax.executor import loop as X
from blink_jax.native import ffi as F
from blink_jax.native import host_memory


class XlaScheduler:
  def __init__(self, cfg: F.SchedConfig, device: jax.Device, region=None):
    F.register_targets()
    self.device = device
    self.registered = None
    if device.platform == "gpu":  # the GPU reads the mailbox through a mapped pointer
      self.registered = host_memory.Registration(region.address, region.buf.nbytes)
      cfg = cfg.replace(mailbox=self.registered.device_address)
    self.cfg = cfg
    put = lambda a: jax.device_put(a, device)
    self.state = put(F.initial_state(cfg))
    self.history = put(np.zeros((cfg.max_seqs, cfg.max_context), np.int32))
    self._pt = put(np.zeros((cfg.max_seqs, cfg.max_pages_per_seq), np.int32))
    self._words = None
    self._sched = jax.jit(lambda s, h, p: X.schedule_call(cfg, s, h, p), donate_argnums=(0, 1, 2))
    self._commit = jax.jit(lambda s, h, p, w, *outs: X.commit_call(cfg, s, h, p, w, *outs),
                           donate_argnums=(0, 1))

  @property
  def page_table(self):
    return np.asarray(self._pt)

  def schedule(self):
    self.state, self.history, self._pt, self._words = self._sched(self.state, self.history,
                                                                  self._pt)
    return np.asarray(self._words)

  def commit(self, sampled, logprobs, top_ids, top_lps, row_lps=None, row_top_ids=None,
             row_top_lps=None):
    put = lambda a: jax.device_put(a, self.device)
    rows, k = self.cfg.token_budget, np.shape(top_ids)[1]
    if row_lps is None:  # no prompt logprobs asked
      row_lps, row_top_ids, row_top_lps = (np.zeros(rows), np.zeros((rows, k)),
                                           np.zeros((rows, k)))
    outs = (put(np.asarray(sampled, np.int32)), put(np.asarray(logprobs, np.float32)),
            put(np.asarray(top_ids, np.int32)), put(np.asarray(top_lps, np.float32)),
            put(np.asarray(row_lps, np.float32)), put(np.asarray(row_top_ids, np.int32)),
            put(np.asarray(row_top_lps, np.float32)))
    self.state, self.history = self._commit(self.state, self.history, self._pt, self._words,
                                            *outs)

  def summary(self):
    return F.summarize(self.cfg, np.asarray(self.state))

  def close(self):
    if self.registered is not None:
      jax.block_until_ready(self.state)
      self.registered.release()
      self.registered = None
