"""On-device sampling: filters against a sort-based reference, seeds, logprobs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blink_jax.model.sampling import _filtered, top_n, sample


def _reference_keep(x, k, p):
  order = np.argsort(-x)
  keep = np.zeros_like(x, bool)
  kk = len(x) if k == 0 else min(k, len(x))
  keep[order[:kk]] = True
  probs = np.exp(x - x.max())
  probs /= probs.sum()
  mass, chosen = 0.0, np.zeros_like(keep)
  if p >= 1.0:
    return keep
  for i in order:
    chosen[i] = True
    mass += probs[i]
    if mass >= p:
      break
  return keep & chosen


@pytest.mark.parametrize("seed", range(5))
def test_filter_matches_sorting_reference(seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(6, 300)).astype(np.float32) * 3
  k = np.array([0, 1, 5, 50, 0, 300], np.int32)
  p = np.array([1.0, 1.0, 0.9, 0.5, 0.3, 0.99], np.float32)
  out = np.asarray(_filtered(jnp.asarray(x), jnp.ones(6), jnp.asarray(k), jnp.asarray(p)))
  for r in range(6):
    np.testing.assert_array_equal(np.isfinite(out[r]), _reference_keep(x[r], k[r], p[r]))


def test_top_n_matches_sort():
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 1000))
  vals, ids = top_n(x, 5)
  np.testing.assert_array_equal(np.asarray(ids), np.argsort(-np.asarray(x), axis=1)[:, :5])
  np.testing.assert_allclose(np.asarray(vals), -np.sort(-np.asarray(x), axis=1)[:, :5])


def test_sample_is_a_function_of_seed_and_position():
  logits = jax.random.normal(jax.random.PRNGKey(1), (3, 50))
  z = (jnp.zeros(3), jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2)))
  args = lambda pos: (logits, jnp.ones(3), jnp.ones(3), jnp.zeros(3, jnp.int32),
                      jnp.array([7, 7, 8]), jnp.zeros(3, jnp.int32), pos, -jnp.ones(3, jnp.int32), z)
  a = sample(*args(jnp.array([4, 4, 4])), max_top=2)[0]
  b = sample(*args(jnp.array([4, 4, 4])), max_top=2)[0]
  np.testing.assert_array_equal(a, b)
  # Rows 0 and 1 share seed, position and logits only if the logits are equal: here they
  # differ, so check determinism per row by permuting the batch instead.
  perm = sample(logits[::-1], jnp.ones(3), jnp.ones(3), jnp.zeros(3, jnp.int32),
                jnp.array([8, 7, 7]), jnp.zeros(3, jnp.int32), jnp.array([4, 4, 4]),
                -jnp.ones(3, jnp.int32), z, max_top=2)[0]
  np.testing.assert_array_equal(np.asarray(perm)[::-1], np.asarray(a))


def test_greedy_and_logprobs():
  logits = jax.random.normal(jax.random.PRNGKey(2), (2, 40))
  z = (jnp.zeros(2), jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3)))
  tok, lp, ids, lps = sample(logits, jnp.zeros(2), jnp.ones(2), jnp.zeros(2, jnp.int32),
                             jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
                             jnp.array([3, -1]), z, max_top=3)
  ref = jax.nn.log_softmax(logits)
  np.testing.assert_array_equal(tok, jnp.argmax(logits, -1))
  np.testing.assert_allclose(lp, ref[jnp.arange(2), tok], atol=1e-6)
  np.testing.assert_array_equal(ids[0], np.argsort(-np.asarray(ref[0]))[:3])
