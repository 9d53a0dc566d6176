"""On-device sampling: filters against a sort-based reference, seeds, logprobs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from blink_jax.kernels import cuda_sampler
from blink_jax.model.sampling import _draw, _filtered, argmax, top_n, sample


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


def _threshold_keep(x, k, p):
  """The sorting reference with ties: every token as likely as the last one kept is kept
  (None where the mass reaches p within rounding of a tie's edge: either answer is right)."""
  s = np.sort(x.astype(np.float64))[::-1]
  t = s[min(k, len(s)) - 1] if k > 0 else -np.inf
  if p < 1.0:
    c = np.cumsum(np.exp(s - s[0]) / np.exp(s - s[0]).sum())
    if np.min(np.abs(c - p)) < 1e-4:
      return None
    t = max(t, s[np.argmax(c >= p)])
  return x >= t


_filtered_jit = jax.jit(_filtered, static_argnums=(4, 5))


# The thresholds spread over the logits' range, not over the tokens, so the way count and
# the vocabulary size do not interact; XLA's CPU compiler takes 9-27 s over a search of 3 or
# 15 ways at vocabularies under 32 (against 2-4 s at 37 or 600), so the 2-token vocabulary
# is searched one way and by thresholds only.
_SHAPES = [(2, 1), (2, "thresholds")] + [(v, w) for v in (37, 600)
                                         for w in (1, 3, 15, "thresholds")]


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(_SHAPES))
def test_filter_matches_sorting_reference_any_shape(seed, shape):
  """Vocabulary sizes, ties (logits on a coarse grid), every way count, and the thresholds
  found at once (`cuda_sampler.thresholds`' answer: its sort-based stand-in off the GPU)."""
  vocab, ways = shape
  rng = np.random.default_rng(seed)
  x = (np.round(rng.normal(size=(4, vocab)) * 4) / 2).astype(np.float32)
  k = rng.integers(0, vocab + 2, size=4).astype(np.int32)
  p = rng.choice([1.0, 0.95, 0.5, 0.1], size=4).astype(np.float32)
  by = (1, cuda_sampler.reference_thresholds) if ways == "thresholds" else (ways, None)
  out = np.asarray(_filtered_jit(jnp.asarray(x), jnp.ones(4), jnp.asarray(k), jnp.asarray(p),
                                 *by))
  for r in range(4):
    ref = _threshold_keep(x[r], k[r], p[r])
    if ref is not None:
      np.testing.assert_array_equal(np.isfinite(out[r]), ref, err_msg=f"row {r}")


def _chi_square_p(counts, probs):
  from scipy import stats
  probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
  expected = probs * counts.sum()
  keep = expected > 0
  assert counts[~keep].sum() == 0, "a token of zero probability was drawn"
  return stats.chisquare(counts[keep], expected[keep]).pvalue


@pytest.mark.parametrize("vocab", [7, 512, 1300])
def test_draw_follows_the_softmax(vocab):
  """The inverse-CDF draw against its distribution: a chi-square test over 40,000 draws per
  row, one row with a -inf (filtered) tail and a vocabulary that is not a block multiple."""
  rng = np.random.default_rng(vocab)
  x = rng.normal(size=(2, vocab)).astype(np.float32)
  x[1, vocab // 2:] = -np.inf
  n = 40_000
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(5), i))(jnp.arange(n))
  draw = jax.jit(jax.vmap(lambda k, row: _draw(k[None], row[None])[0], in_axes=(0, None)))
  for r in range(2):
    tokens = np.asarray(draw(keys, jnp.asarray(x[r])))
    counts = np.bincount(tokens, minlength=vocab)
    probs = np.exp(x[r] - x[r].max())
    probs /= probs.sum()
    assert _chi_square_p(counts, probs) > 1e-4


def test_sample_with_top_p_follows_the_filtered_softmax():
  """sample() end to end (temperature, top-p) against the sorting reference's nucleus."""
  vocab, n = 300, 30_000
  x = np.random.default_rng(3).normal(size=vocab).astype(np.float32) * 2
  keep = _reference_keep(x / 0.7, 0, 0.8)
  probs = np.where(keep, np.exp((x - x.max()) / 0.7), 0.0)
  probs /= probs.sum()
  z = (jnp.zeros(n), jnp.zeros((n, 0), jnp.int32), jnp.zeros((n, 0)))
  tokens = jax.jit(lambda lg: sample(
      lg, jnp.full(n, 0.7), jnp.full(n, 0.8), jnp.zeros(n, jnp.int32), jnp.arange(n),
      jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32), -jnp.ones(n, jnp.int32), z,
      max_top=0)[0])(jnp.broadcast_to(jnp.asarray(x), (n, vocab)))
  assert _chi_square_p(np.bincount(np.asarray(tokens), minlength=vocab), probs) > 1e-4


_argmax_jit = jax.jit(argmax)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 511, 512, 1300]))
def test_argmax_is_jnp_argmax(seed, vocab):
  """Ties (a coarse grid) and -inf rows: the first of equal maxima; a row with NaNs still
  gets an index inside the vocabulary."""
  rng = np.random.default_rng(seed)
  x = np.round(rng.normal(size=(5, vocab)) * 2).astype(np.float32)
  x[1] = -np.inf
  x[3, rng.integers(vocab, size=2)] = x[3].max() + 1  # a tie at the top
  np.testing.assert_array_equal(np.asarray(_argmax_jit(jnp.asarray(x))),
                                np.argmax(x, axis=-1))
  x[2, rng.integers(vocab)] = np.nan
  x[4] = np.nan
  assert ((0 <= (got := np.asarray(_argmax_jit(jnp.asarray(x))))) & (got < vocab)).all()


@pytest.mark.parametrize("ways", [1, 15])  # 1: the engine's, a plain bisection
def test_sampler_lowered_for_cuda_has_nothing_a_cuda_graph_loop_cannot_hold(ways):
  """The whole sampler (greedy, filters, draw, logprobs) exported for CUDA: no sort (a CUB
  call), no cumulative sum (a reduce_window or scan, which XLA may make a CUB scan), no
  custom call, no loop (docs/ARCHITECTURE.md, "CUDA-graph rules")."""
  import re

  from tests.cuda_lowering import lower_for_cuda
  rows, vocab = 4, 1000
  s = jax.ShapeDtypeStruct
  z = (s((rows,), jnp.float32), s((rows, 2), jnp.int32), s((rows, 2), jnp.float32))
  args = (s((rows, vocab), jnp.float32), s((rows,), jnp.float32), s((rows,), jnp.float32),
          *(s((rows,), jnp.int32),) * 5, z)
  text = lower_for_cuda(lambda *a: sample(*a, max_top=2, search_ways=ways), *args)
  ops = set(re.findall(r"\b(?:stablehlo|chlo)\.[a-z_]+|custom_call", text))
  assert "stablehlo.case" in ops and "stablehlo.exponential" in ops  # the sampled path is in
  assert not ops & {"stablehlo.sort", "chlo.scan", "stablehlo.reduce_window", "stablehlo.while",
                    "custom_call", "stablehlo.rng", "stablehlo.rng_bit_generator"}, ops
