"""The Pallas paged prefill attention equals the jnp oracle (Pallas' interpreter on CPU; the
compiled Triton kernel on the GPU, marked `gpu`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from blink_jax.model.attention import kv_rows, write_kv
from blink_jax.kernels import pallas_prefill
from blink_jax.kernels.pallas_attention import TILE_BYTES
from blink_jax.kernels.pallas_prefill import (_segments, block_tokens, paged_prefill_attention,
                                              prefill_pages_per_block, program_rows)
from blink_jax.model.config import CONFIGS
from tests.cuda_lowering import check_triton_calls, lower_for_cuda, require_gpu
from tests.oracles import paged_attention


def _case(rng, *, tokens, num_heads, num_kv_heads, head_dim, page_size, max_pages, seqs,
          dtype=jnp.float32):
  """Random pages and page tables; the step's tokens come in runs of one sequence (as a
  ragged batch lays them out), then a few padding rows (seq_id -1)."""
  num_pages = seqs * max_pages + 3
  table = rng.permutation(num_pages)[:seqs * max_pages].reshape(seqs, max_pages)
  kv_pages = jnp.asarray(rng.standard_normal((num_pages, page_size,
                                              2 * num_kv_heads * head_dim)), dtype)
  q = jnp.asarray(rng.standard_normal((tokens, num_heads, head_dim)), dtype)
  seq_ids = np.repeat(rng.integers(0, seqs, tokens), rng.integers(1, 12, tokens))[:tokens]
  seq_ids = seq_ids.astype(np.int32)
  seq_ids[tokens - rng.integers(0, 3):] = -1
  positions = rng.integers(0, max_pages * page_size, tokens).astype(np.int32)
  return q, kv_pages, jnp.asarray(table, jnp.int32), seq_ids, positions


def _check(args, *, window, softcap, scale, atol=2e-5, **kw):
  q, kv_pages, table, seq_ids, positions = args
  with jax.default_matmul_precision("highest"):  # XLA's GPU default for f32 dots is TF32
    want = paged_attention(q, kv_pages, table, seq_ids, positions,
                           window=window, softcap=softcap, scale=scale)
  got = paged_prefill_attention(q, kv_pages, table, seq_ids, positions, window=window,
                                softcap=softcap, scale=scale, **kw)
  assert got.shape == want.shape and got.dtype == want.dtype
  real = np.asarray(seq_ids) >= 0
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  np.testing.assert_allclose(np.asarray(got, np.float32)[real],
                             np.asarray(want, np.float32)[real], atol=atol, rtol=atol)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 40), group=st.sampled_from([1, 2, 4, 8]),
       num_kv_heads=st.sampled_from([1, 2]), page_size=st.sampled_from([4, 8]),
       max_pages=st.integers(1, 7), window=st.sampled_from([None, 5, 17]),
       softcap=st.sampled_from([None, 20.0]), splits=st.sampled_from([None, 1, 2, 4]),
       pages_per_block=st.sampled_from([1, 2]))
def test_matches_the_reference(seed, tokens, group, num_kv_heads, page_size, max_pages, window,
                               softcap, splits, pages_per_block):
  args = _case(np.random.default_rng(seed), tokens=tokens, num_heads=group * num_kv_heads,
               num_kv_heads=num_kv_heads, head_dim=16, page_size=page_size,
               max_pages=max_pages, seqs=3)
  _check(args, window=window, softcap=softcap, scale=0.3, splits=splits,
         pages_per_block=pages_per_block)


def _check_split(rng, *, tokens, decode, head, window, head_dim, page_size, max_pages,
                 dtype=jnp.float32, atol=2e-5):
  """A mixed step (decode rows of their own sequences first, then two prompt chunks from
  position 0, then padding): its first `head` rows through the decode kernel and the rest
  through the prefill kernel (`select.head_then_rest`, what larger steps run) against the
  oracle."""
  import functools
  from blink_jax.kernels import pallas_attention
  from blink_jax.kernels.select import head_then_rest
  q, kv_pages, table, _, _ = _case(rng, tokens=tokens, num_heads=4, num_kv_heads=1,
                                   head_dim=head_dim, page_size=page_size,
                                   max_pages=max_pages, seqs=decode + 2, dtype=dtype)
  rest = tokens - decode - 2
  prompts = [(decode, rest // 3), (decode + 1, rest - rest // 3)]
  seq_ids = np.array(list(range(decode)) + [s for s, n in prompts for _ in range(n)], np.int32)
  positions = np.array(list(rng.integers(0, max_pages * page_size, decode)) +
                       [p for _, n in prompts for p in range(n)], np.int32)
  seq_ids = np.pad(seq_ids, (0, tokens - len(seq_ids)), constant_values=-1)
  positions = np.pad(positions, (0, tokens - len(positions)))
  split = functools.partial(
      head_then_rest, head=head, head_fn=pallas_attention.paged_decode_attention,
      rest_fn=paged_prefill_attention)
  scale = head_dim ** -0.5
  with jax.default_matmul_precision("highest"):
    want = paged_attention(q, kv_pages, table, seq_ids, positions, window=window,
                           softcap=None, scale=scale)
  got = split(q, kv_pages, table, seq_ids, positions, window=window, softcap=None, scale=scale)
  assert got.shape == want.shape and got.dtype == want.dtype
  real = seq_ids >= 0
  np.testing.assert_allclose(np.asarray(got, np.float32)[real],
                             np.asarray(want, np.float32)[real], atol=atol, rtol=atol)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), decode=st.integers(0, 12), head=st.integers(1, 32),
       window=st.sampled_from([None, 5]))
def test_a_step_split_at_its_head_equals_the_reference(seed, decode, head, window):
  """Whether the decode rows fill the head, end before it (the prompt chunks then go to the
  prefill kernel whole), or there are none."""
  _check_split(np.random.default_rng(seed), tokens=32, decode=decode, head=head, window=window,
               head_dim=16, page_size=4, max_pages=10)


def test_leading_single_rows_are_a_steps_decode_rows():
  from blink_jax.kernels.select import leading_single_rows
  n = lambda seq, limit=8: int(leading_single_rows(np.array(seq, np.int32), limit))  # noqa: E731
  assert n([4, 7, 2, 5, 5, 5, -1, -1]) == 3  # three decode rows, a chunk, padding
  assert n([5, 5, 5, 4, 7]) == 0             # no decode rows: a chunk first
  assert n([4, 7, 2, 9], limit=2) == 2       # at most `limit`
  assert n([4, 7, 2, 9]) == 4                # decode rows only
  assert n([4, 7, 3, 2, 2]) == 3             # a one-token chunk (3) counts: exact either way
  assert n([-1, -1, 4]) == 0                 # padding is no decode row


def test_a_prefill_chunk_reads_what_write_kv_wrote():
  # A 30-token chunk of one sequence at positions 10..39 after 10 cached tokens, then two
  # decode tokens of other sequences in the same step: the causal mask over fresh keys.
  rng = np.random.default_rng(1)
  q, kv_pages, table, _, _ = _case(rng, tokens=32, num_heads=4, num_kv_heads=1, head_dim=16,
                                   page_size=4, max_pages=12, seqs=3)
  seq_ids = np.array([0] * 30 + [1, 2], np.int32)
  positions = np.array(list(range(10, 40)) + [5, 17], np.int32)
  k = jnp.asarray(rng.standard_normal((32, 1, 16)), jnp.float32)
  kv_pages = write_kv(kv_pages, kv_rows(k, -k), table, seq_ids, positions)
  _check((q, kv_pages, table, seq_ids, positions), window=None, softcap=None, scale=0.25)


def test_bf16_is_close_to_the_reference():
  args = _case(np.random.default_rng(2), tokens=24, num_heads=4, num_kv_heads=1, head_dim=32,
               page_size=8, max_pages=4, seqs=2, dtype=jnp.bfloat16)
  _check(args, window=None, softcap=None, scale=0.2, atol=3e-2)


def test_segments_are_the_runs_of_each_block():
  seq = jnp.array([[3, 3, 1, 1], [-1, -1, -1, -1]])
  first = jnp.array([[0, 0, 2, 1], [0, 0, 0, 0]])
  end = jnp.array([[4, 5, 3, 3], [1, 1, 1, 1]])
  segments, run = map(np.asarray, _segments(seq, first, end))
  np.testing.assert_array_equal(segments[0], [[3, 1, -1, -1], [0, 1, 0, 0], [5, 3, 0, 0]])
  np.testing.assert_array_equal(segments[1][0], [-1, -1, -1, -1])  # padding: no segment
  np.testing.assert_array_equal(run, [[0, 0, 1, 1], [0, 0, 0, 0]])
  assert block_tokens(4) == 16 and block_tokens(1) == 64 and block_tokens(8) == 8
  assert block_tokens(4, 128) == 32 and block_tokens(16, 32) == 2


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("page_size", [8, 16, 32])
def test_key_blocks_fit_the_tile_budget(name, page_size):
  """Every model's key blocks: a power of two of pages, at least 16 keys (the smallest Triton
  dot), K and V tiles within the prefill tile bytes and float32 scores within TILE_BYTES
  unless 16 keys alone pass them (an SM's shared memory holds both, two stages deep)."""
  cfg = CONFIGS[name]
  kv_pages = jax.ShapeDtypeStruct((64, page_size, 2 * cfg.num_kv_heads * cfg.head_dim),
                                  jnp.bfloat16)
  rows = program_rows(cfg.num_heads // cfg.num_kv_heads)
  pages = prefill_pages_per_block(kv_pages, cfg.head_dim, rows)
  keys = pages * page_size
  assert pages & (pages - 1) == 0 and keys >= 16
  if keys > 16:
    assert keys * cfg.head_dim * 2 <= pallas_prefill._TILE_BYTES
    assert rows * keys * 4 <= TILE_BYTES


def test_the_1b_shape_walks_32_key_blocks():
  """The setting measured fastest for the 1B shape's mixed steps (docs/PERFORMANCE.md, "The
  one-stage decode kernel end to end and the prefill kernel's key blocks (revision 6edd339)"):
  32 keys a block at the engine's 16-token pages, where the decode kernel reads 64."""
  cfg = CONFIGS["gemma3-1b"]
  kv_pages = jax.ShapeDtypeStruct((64, 16, 2 * cfg.head_dim), jnp.bfloat16)
  rows = program_rows(cfg.num_heads // cfg.num_kv_heads)
  assert prefill_pages_per_block(kv_pages, cfg.head_dim, rows) * 16 == 32


def test_lowers_to_a_triton_kernel_for_cuda():
  """Gemma 3 1B's attention shape, bf16, a 256-token step: the attention and the merge,
  16 blocks of 16 tokens; with one split the attention alone."""
  shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (
      ((256, 4, 256), jnp.bfloat16), ((4864, 16, 512), jnp.bfloat16), ((64, 76), jnp.int32),
      ((256,), jnp.int32), ((256,), jnp.int32))]
  text = lower_for_cuda(lambda *a: paged_prefill_attention(*a, window=512, softcap=None,
                                                           scale=0.0625, interpret=False),
                        *shapes)
  # 16 blocks of 64 rows, 8 splits each: about one program per SM (the prefill kernel's
  # aim of 128, half the decode kernel's).
  check_triton_calls(text, 2, (16, 1, 8))
  # 128 rows a program (32 tokens) at 8 warps, 3 stages: 8 blocks.
  text = lower_for_cuda(lambda *a: paged_prefill_attention(
      *a, window=512, softcap=None, scale=0.0625, block_rows=128, num_warps=8, num_stages=3,
      interpret=False), *shapes)
  check_triton_calls(text, 2, (8, 1, 16))
  assert "num_warps = 8" in text
  # One split: the kernel writes the normalised output, no merge launch.
  text = lower_for_cuda(lambda *a: paged_prefill_attention(
      *a, window=512, softcap=None, scale=0.0625, splits=1, interpret=False), *shapes)
  check_triton_calls(text, 1, (16, 1, 1))


@pytest.mark.gpu
def test_compiled_split_step_matches_the_reference_on_the_gpu():
  """A burst's step on the GPU: 100 decode rows at up to 1,200 tokens of context, then two
  prompt chunks; the head (256 rows, decode_head=256) ends inside a chunk."""
  require_gpu()
  rng = np.random.default_rng(4)
  for dtype, atol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
    for window in (None, 512):
      _check_split(rng, tokens=1024, decode=100, head=256, window=window, head_dim=256,
                   page_size=16, max_pages=76, dtype=dtype, atol=atol)


@pytest.mark.gpu
def test_compiled_kernel_matches_the_reference_on_the_gpu():
  require_gpu()
  rng = np.random.default_rng(3)
  for dtype, atol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
    args = _case(rng, tokens=256, num_heads=4, num_kv_heads=1, head_dim=256, page_size=16,
                 max_pages=76, seqs=4, dtype=dtype)
    for window in (None, 512):
      _check(args, window=window, softcap=None, scale=256 ** -0.5, atol=atol, interpret=False)
