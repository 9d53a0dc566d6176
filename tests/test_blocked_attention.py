"""The blocked paged attention (the CPU kernel: key blocks up to the step's context, online
softmax) equals the jnp oracle, which reads every row's whole page table."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from blink_jax.kernels import blocked_attention
from tests.oracles import paged_attention
from tests.test_pallas_prefill import _case

# The kernel has no jit of its own (it runs inside the step's): compiled here the same way.
paged_attention_blocked = jax.jit(blocked_attention.paged_attention_blocked,
                                  static_argnames=("window", "softcap", "scale", "key_block"))


def _check(args, *, window, softcap, scale, key_block, atol=2e-5):
  q, kv_pages, table, seq_ids, positions = args
  want = paged_attention(q, kv_pages, table, seq_ids, positions, window=window,
                         softcap=softcap, scale=scale)
  got = paged_attention_blocked(q, kv_pages, table, seq_ids, positions, window=window,
                                softcap=softcap, scale=scale, key_block=key_block)
  assert got.shape == want.shape and got.dtype == want.dtype
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  real = np.asarray(seq_ids) >= 0
  np.testing.assert_allclose(np.asarray(got, np.float32)[real],
                             np.asarray(want, np.float32)[real], atol=atol, rtol=atol)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 70), group=st.sampled_from([1, 2, 4]),
       num_kv_heads=st.sampled_from([1, 2]), page_size=st.sampled_from([4, 8]),
       max_pages=st.integers(1, 9), window=st.sampled_from([None, 5, 17]),
       softcap=st.sampled_from([None, 20.0]), key_block=st.sampled_from([1, 8, 16, 128]))
def test_matches_the_reference(seed, tokens, group, num_kv_heads, page_size, max_pages, window,
                               softcap, key_block):
  args = _case(np.random.default_rng(seed), tokens=tokens, num_heads=group * num_kv_heads,
               num_kv_heads=num_kv_heads, head_dim=16, page_size=page_size,
               max_pages=max_pages, seqs=3)
  _check(args, window=window, softcap=softcap, scale=0.3, key_block=key_block)


def test_short_contexts_in_a_long_page_table():
  # Decode rows of three sequences, all far shorter than the page table: the blocks past the
  # longest context are never read (garbage there, NaN even, changes nothing).
  q, kv_pages, table, _, _ = _case(np.random.default_rng(3), tokens=4, num_heads=4,
                                   num_kv_heads=1, head_dim=16, page_size=4, max_pages=64,
                                   seqs=3)
  seq_ids = np.array([0, 1, 2, -1], np.int32)
  positions = np.array([3, 9, 20, 0], np.int32)
  args = (q, kv_pages, table, seq_ids, positions)
  _check(args, window=None, softcap=None, scale=0.25, key_block=8)
  used = np.asarray(table)[:, :6].ravel()
  unused = np.setdiff1d(np.arange(kv_pages.shape[0]), used)
  poisoned = kv_pages.at[unused].set(jnp.nan)
  got = paged_attention_blocked(q, poisoned, table, seq_ids, positions, window=None,
                                softcap=None, scale=0.25, key_block=8)
  want = paged_attention_blocked(q, kv_pages, table, seq_ids, positions, window=None,
                                 softcap=None, scale=0.25, key_block=8)
  np.testing.assert_array_equal(np.asarray(got)[:3], np.asarray(want)[:3])


def test_a_step_of_padding_only_is_finite():
  q, kv_pages, table, _, _ = _case(np.random.default_rng(4), tokens=5, num_heads=2,
                                   num_kv_heads=1, head_dim=16, page_size=4, max_pages=3, seqs=2)
  out = paged_attention_blocked(q, kv_pages, table, np.full(5, -1, np.int32),
                                np.zeros(5, np.int32), window=None, softcap=None, scale=0.3)
  assert np.all(np.isfinite(np.asarray(out)))


def test_bf16_is_close_to_the_reference():
  args = _case(np.random.default_rng(2), tokens=24, num_heads=4, num_kv_heads=1, head_dim=32,
               page_size=8, max_pages=4, seqs=2, dtype=jnp.bfloat16)
  _check(args, window=None, softcap=None, scale=0.2, key_block=16, atol=3e-2)
