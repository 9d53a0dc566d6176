"""The loop probes behind bench/diag/loop_overhead.py and bench/step.py (CPU: timing and
composition only; the scheduler probes need a GPU mailbox)."""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from bench.diag import loop_probes as D


def test_composed_body_runs_each_part_on_its_own_carry():
  body, rest, _, state_at = D.variant("trivial+switch")
  assert state_at is None and len(rest) == 2
  i, a, b = body((jnp.int32(0), *rest))
  ta, tb = D.variant("trivial")[0], D.variant("switch")[0]
  np.testing.assert_allclose(a, ta((jnp.int32(0), rest[0]))[1])
  np.testing.assert_allclose(b, tb((jnp.int32(0), rest[1]))[1])
  assert int(i) == 1


def test_model_probe_decodes_greedily():
  body, (params, kv, tokens), _, _ = D.variant("model-tiny-b2")
  i, _, _, nxt = body((jnp.int32(0), params, kv, tokens))
  assert nxt.shape == (2,) and nxt.dtype == jnp.int32 and int(i) == 1


def test_measure_reports_loop_kind_and_ratio():
  rows = D.measure("nested", [0], iters=50, repeats=2)
  assert rows[0]["variant"] == "nested" and rows[0]["ratio"] == 1.0
  assert rows[0]["device_while"] is False  # CPU: no command buffers
  assert rows[0]["us_per_iter_median"] > 0 and len(rows[0]["us_per_iter_all"]) == 2


def test_unknown_variant_is_named():
  with pytest.raises(ValueError, match="nope"):
    D.variant("nope")


def test_cond_wrapper_takes_the_body_branch():
  body, rest, _, _ = D.variant("cond-trivial")
  i, x = body((jnp.int32(3), *rest))
  np.testing.assert_allclose(x, rest[0] * 1.0001)
  assert int(i) == 4


def test_engine_probe_serves_its_requests():
  """The engine-step probe really prefills and decodes the requests in its mailbox."""
  import jax
  from jax import lax

  from blink_jax.client import mailbox as M
  body, rest, box, _ = D.variant("enginehost-tiny-b2")
  out = jax.jit(lambda r: lax.while_loop(lambda c: c[0] < 12, body, (jnp.int32(0), *r)))(rest)
  jax.block_until_ready(out)
  h = M.read_header(box.host)
  assert int(h["running"]) == 2 and int(h["steps"]) == 12
  assert int(h["tokens_generated"]) >= 2 + 2  # a first token per prefill, then decodes
  box.reset()
  assert int(M.read_header(box.host)["tokens_generated"]) == 0


def test_bench_step_without_command_buffers_keeps_the_decode_flags(monkeypatch):
  """Kernel-by-kernel steps (for profiles) must be the engine's program: same decode flags."""
  from blink_jax.executor import xla_flags
  from bench import step as bench_step
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  bench_step.configure_xla(command_buffers=False)
  flags = os.environ["XLA_FLAGS"].split()
  assert flags[0] == "--xla_dump_to=/tmp/x"
  assert "--xla_gpu_enable_command_buffer=" in flags
  assert set(xla_flags.DECODE_FLAGS) <= set(flags)
