"""The Pallas paged decode attention equals the jnp oracle (Pallas' interpreter on CPU; the
compiled Triton kernel on the GPU, marked `gpu`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from blink_jax.model.attention import kv_rows, write_kv
from blink_jax.kernels import pallas_attention
from blink_jax.kernels.pallas_attention import default_splits, paged_decode_attention
from tests.cuda_lowering import TRITON, lower_for_cuda, require_gpu
from tests.oracles import paged_attention


def _case(rng, *, tokens, num_heads, num_kv_heads, head_dim, page_size, max_pages, seqs,
          dtype=jnp.float32):
  """Random pages with random page tables (distinct pages per sequence) and random rows;
  a quarter of the rows are padding (seq_id -1)."""
  num_pages = seqs * max_pages + 3
  perm = rng.permutation(num_pages)[:seqs * max_pages].reshape(seqs, max_pages)
  width = 2 * num_kv_heads * head_dim  # keys, then values
  kv_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, width)), dtype)
  q = jnp.asarray(rng.standard_normal((tokens, num_heads, head_dim)), dtype)
  seq_ids = rng.integers(0, seqs, tokens).astype(np.int32)
  seq_ids[rng.random(tokens) < 0.25] = -1
  positions = rng.integers(0, max_pages * page_size, tokens).astype(np.int32)
  return q, kv_pages, jnp.asarray(perm, jnp.int32), seq_ids, positions


def _check(args, *, window, softcap, scale, splits, pages_per_block, atol=2e-5, **kw):
  q, kv_pages, table, seq_ids, positions = args
  # Full f32 precision: XLA's GPU default for f32 dots is TF32 (1e-4 off at 0.06).
  with jax.default_matmul_precision("highest"):
    want = paged_attention(q, kv_pages, table, seq_ids, positions,
                           window=window, softcap=softcap, scale=scale)
  got = paged_decode_attention(q, kv_pages, table, seq_ids, positions, window=window,
                               softcap=softcap, scale=scale, splits=splits,
                               pages_per_block=pages_per_block, **kw)
  assert got.shape == want.shape and got.dtype == want.dtype
  real = np.asarray(seq_ids) >= 0
  assert np.all(np.isfinite(np.asarray(got, np.float32)))  # padding rows: finite garbage
  np.testing.assert_allclose(np.asarray(got, np.float32)[real],
                             np.asarray(want, np.float32)[real], atol=atol, rtol=atol)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), page_size=st.sampled_from([2, 4, 8]),
       max_pages=st.integers(1, 12), group=st.sampled_from([1, 2, 4]),
       num_kv_heads=st.sampled_from([1, 2]), window=st.sampled_from([None, 3, 9]),
       softcap=st.sampled_from([None, 20.0]), splits=st.sampled_from([None, 1, 2, 8]),
       pages_per_block=st.sampled_from([1, 2, 4]))
def test_matches_the_reference(seed, page_size, max_pages, group, num_kv_heads, window,
                               softcap, splits, pages_per_block):
  rng = np.random.default_rng(seed)
  args = _case(rng, tokens=5, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
               head_dim=8, page_size=page_size, max_pages=max_pages, seqs=3)
  _check(args, window=window, softcap=softcap, scale=0.3, splits=splits,
         pages_per_block=pages_per_block)


def test_reads_what_write_kv_wrote_across_splits():
  """A decode step at the end of a long sequence: its own K/V (just written) and keys in
  every split of the page list count."""
  rng = np.random.default_rng(0)
  q, kv_pages, table, _, _ = _case(rng, tokens=1, num_heads=4, num_kv_heads=1, head_dim=16,
                                   page_size=4, max_pages=16, seqs=2)
  seq_ids, positions = np.array([1, 0], np.int32), np.array([63, 17], np.int32)
  q = jnp.concatenate([q, q * 0.5])
  k_new = jnp.asarray(rng.standard_normal((2, 1, 16)), jnp.float32) * 4
  kv_pages = write_kv(kv_pages, kv_rows(k_new, -k_new), table, seq_ids, positions)
  for window in (None, 10):
    _check((q, kv_pages, table, seq_ids, positions), window=window, softcap=None,
           scale=0.25, splits=4, pages_per_block=2)


def test_bf16_is_close_to_the_reference():
  rng = np.random.default_rng(1)
  args = _case(rng, tokens=4, num_heads=4, num_kv_heads=1, head_dim=16, page_size=4,
               max_pages=8, seqs=2, dtype=jnp.bfloat16)
  _check(args, window=None, softcap=None, scale=0.25, splits=2, pages_per_block=2, atol=3e-2)


def test_default_splits_fill_the_gpu_at_small_batches():
  cap = pallas_attention._MAX_SPLITS
  assert default_splits(tokens=1, num_kv_heads=1, num_blocks=19) == min(32, cap)
  assert default_splits(tokens=1, num_kv_heads=1, num_blocks=3) == 4  # no more than blocks
  assert default_splits(tokens=8, num_kv_heads=1, num_blocks=19) == min(32, cap)
  assert default_splits(tokens=64, num_kv_heads=1, num_blocks=19) == 4
  assert default_splits(tokens=64, num_kv_heads=8, num_blocks=19) == 1


def test_programs_are_shared_out_among_the_live_rows():
  """A decode head of 256 rows has default_splits' one program a row; with 48 live rows
  each takes 4 (the largest power of two that fits), with one 32 (no more than the blocks
  of its page list), with all live one each; the live rows run to the last real one."""
  def counts(live_rows, tokens=256, most=32):
    valid = np.zeros(tokens, bool)
    valid[live_rows] = True
    return tuple(int(c) for c in pallas_attention.live_splits(
        jnp.asarray(valid), tokens * default_splits(tokens, 1, most), most))
  assert counts(np.arange(48)) == (48, 4)
  assert counts([0]) == (1, 32)
  assert counts(np.arange(256)) == (256, 1)
  assert counts([0, 1, 130]) == (131, 1)
  assert counts([]) == (0, 32)
  assert counts([0, 2], tokens=8) == (3, 32)  # 8 x 32 programs at batch 8


def test_a_sliding_window_caps_the_splits_at_its_blocks():
  """Splits in a sliding-window layer: the largest power of two of whole blocks in the
  window (Gemma 3's 512 keys in blocks of 64: 8), at least one; no cap without a window."""
  assert pallas_attention.window_splits(512, 64) == 8
  assert pallas_attention.window_splits(511, 64) == 4
  assert pallas_attention.window_splits(1024, 32) == 32
  assert pallas_attention.window_splits(11, 16) == 1
  assert pallas_attention.window_splits(None, 64) == pallas_attention._MAX_SPLITS


@pytest.mark.parametrize("live", [1, 5, 13])
def test_a_mostly_padded_step_matches_the_reference(live):
  """The decode head's case: 64 rows, the first few live (one padding row among them), the
  rest padding; each live row's context spread over several programs."""
  rng = np.random.default_rng(live)
  q, kv_pages, table, seq_ids, positions = _case(
      rng, tokens=64, num_heads=4, num_kv_heads=1, head_dim=16, page_size=4, max_pages=24,
      seqs=6)
  seq_ids = np.where(np.arange(64) < live, rng.integers(0, 6, 64), -1).astype(np.int32)
  seq_ids[live // 2] = -1 if live > 1 else seq_ids[0]
  for window in (None, 11):
    _check((q, kv_pages, table, seq_ids, positions), window=window, softcap=None, scale=0.25,
           splits=None, pages_per_block=2)


def test_rejects_mismatched_heads():
  rng = np.random.default_rng(2)
  q, kv_pages, table, seq_ids, positions = _case(
      rng, tokens=1, num_heads=3, num_kv_heads=2, head_dim=8, page_size=4, max_pages=2, seqs=1)
  with pytest.raises(ValueError, match="3 query heads"):
    paged_decode_attention(q, kv_pages, table, seq_ids, positions, window=None,
                           softcap=None, scale=1.0)


@pytest.mark.parametrize("window", [None, 512])
def test_lowers_to_a_triton_kernel_for_cuda(window):
  """Pallas' Triton lowering runs in Python, so the CUDA lowering is checked without a GPU
  (Gemma 3 1B attention shape, bf16, batch 1): two Triton custom calls (attention, merge)
  with the expected grids, no interpreter ops."""
  shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (
      ((1, 4, 256), jnp.bfloat16), ((4864, 16, 512), jnp.bfloat16), ((64, 76), jnp.int32),
      ((1,), jnp.int32), ((1,), jnp.int32))]
  text = lower_for_cuda(lambda *a: paged_decode_attention(*a, window=window, softcap=None,
                                                          scale=0.0625, interpret=False),
                        *shapes)
  assert text.count(f"@{TRITON}") == 2
  # default_splits' programs at batch 1 (by KV head; a sliding-window layer's no more than
  # the 8 blocks of 64 keys in its window), then merge programs over (token, KV head,
  # slices of the head dims): each loads all splits of the group's 4 query rows (not the 16
  # padded ones).
  splits = default_splits(1, 1, 19) if window is None else 8
  dims = min(256, 16384 // (splits * 4))
  assert f"grid_x = {splits} : i32, grid_y = 1 : i32, grid_z = 1 : i32" in text
  assert f"grid_x = 1 : i32, grid_y = 1 : i32, grid_z = {256 // dims} : i32" in text
  assert "stablehlo.while" not in text  # the interpreter would loop over the grid


@pytest.mark.gpu
def test_compiled_kernel_matches_the_reference_on_the_gpu():
  """The Triton kernel in the Gemma 3 1B attention shape (4 query heads, 1 KV head, 256
  dims, 16-token pages, 1k context) and a small GQA shape, f32 and bf16."""
  require_gpu()
  rng = np.random.default_rng(3)
  for dtype, atol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
    args = _case(rng, tokens=8, num_heads=4, num_kv_heads=1, head_dim=256, page_size=16,
                 max_pages=76, seqs=4, dtype=dtype)
    for window in (None, 512):
      _check(args, window=window, softcap=None, scale=256 ** -0.5, splits=None,
             pages_per_block=None, atol=atol, interpret=False)  # the engine's defaults
    args = _case(rng, tokens=3, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                 max_pages=10, seqs=2, dtype=dtype)
    _check(args, window=None, softcap=50.0, scale=0.125, splits=2, pages_per_block=4,
           atol=atol, interpret=False)
