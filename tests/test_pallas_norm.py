"""The Pallas norm kernels equal the jnp math: the residual add + RMSNorm
(`model.add_rms_norm`) and the q/k RMSNorm + RoPE + cache rows (`model.prepare_qkv`);
Pallas' interpreter on CPU, the compiled Triton kernels on the GPU (marked `gpu`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from blink_jax.kernels import pallas_norm
from blink_jax.model.gemma import rope_tables
from blink_jax.kernels.pallas_attention import paged_decode_attention, query_rows
from blink_jax.kernels.pallas_norm import add_rms_norm, chunk_size, prepare_qkv
from tests.cuda_lowering import TRITON, lower_for_cuda, require_gpu
from tests.oracles import add_rms_norm as reference
from tests.oracles import prepare_qkv as prepare_reference


def _case(rng, rows, width, dtype):
  x = jnp.asarray(rng.standard_normal((rows, width)), dtype)
  branch = jnp.asarray(rng.standard_normal((rows, width)) * 4, dtype)
  weights = [jnp.asarray(rng.standard_normal(width) * 0.2, dtype) for _ in range(2)]
  return x, branch, *weights


def _check(args, *, eps=1e-6, atol, **kw):
  got = add_rms_norm(*args, eps, **kw)
  want = reference(*args, eps)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=atol, rtol=atol)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 9),
       width=st.sampled_from([16, 48, 64, 80, 144, 640, 1152]))
def test_matches_the_reference(seed, rows, width):
  # Widths with 1 to 9 chunks (Gemma 3 270M: 640 = 5 x 128; 1B: 1152 = 9 x 128).
  _check(_case(np.random.default_rng(seed), rows, width, jnp.float32), atol=1e-5)


def test_bf16_rounds_like_the_reference():
  # Both round the normed branch, then the sum, to bf16; float32 sums in another order may
  # move a value by one bf16 step.
  args = _case(np.random.default_rng(1), 5, 1152, jnp.bfloat16)
  _check(args, atol=1e-2)


def test_keeps_leading_axes():
  x, b, w1, w2 = _case(np.random.default_rng(2), 6, 64, jnp.float32)
  got = add_rms_norm(x.reshape(2, 3, 64), b.reshape(2, 3, 64), w1, w2, 1e-6)
  want = reference(x, b, w1, w2, 1e-6)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g).reshape(6, 64), np.asarray(w), atol=1e-5)


def test_chunks_and_fallback():
  assert chunk_size(1152) == 128 and chunk_size(640) == 128 and chunk_size(2560) == 512
  assert chunk_size(4096) == 1024
  assert pallas_norm.usable(1152) and pallas_norm.usable(640)
  assert not pallas_norm.usable(1000)  # 1000 = 8 x 125: chunks too small


def test_rejects_mismatched_shapes():
  x, b, w1, w2 = _case(np.random.default_rng(3), 2, 64, jnp.float32)
  with pytest.raises(ValueError, match="do not match"):
    add_rms_norm(x, b[:, :32], w1, w2, 1e-6)
  with pytest.raises(ValueError, match="power-of-two factor"):
    add_rms_norm(x[:, :40], b[:, :40], w1[:40], w2[:40], 1e-6)  # 40 = 8 x 5


@pytest.mark.parametrize("width", [640, 1152])
def test_lowers_to_one_triton_kernel_for_cuda(width):
  """Pallas' Triton lowering runs in Python, so the CUDA lowering of the Gemma 3 widths
  (rows that are not a power of two, loaded in 128-wide chunks) is checked without a GPU."""
  shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, width), (1, width), (width,),
                                                             (width,))]
  text = lower_for_cuda(lambda *a: add_rms_norm(*a, eps=1e-6, interpret=False), *shapes)
  assert text.count(f"@{TRITON}") == 1
  assert "stablehlo.while" not in text  # the interpreter would loop over the grid


def _prepare_case(rng, tokens, num_heads, num_kv, head_dim, dtype, normed=True):
  """(the positional arguments of prepare_qkv before eps, the cache and its slots, the
  head-count keywords). The slots are distinct rows of a cache of 4-row pages with a page
  to spare, or one past its end (padding: writes nothing)."""
  qkv = jnp.asarray(rng.standard_normal((tokens, (num_heads + 2 * num_kv) * head_dim)) * 2,
                    dtype)
  positions = jnp.asarray(rng.integers(0, 40_000, tokens), jnp.int32)
  cos, sin = rope_tables(positions, head_dim, 10_000.0, 8.0)
  weights = [jnp.asarray(rng.standard_normal(head_dim) * 0.2, dtype) if normed else None
             for _ in range(2)]
  pages = tokens // 4 + 1
  kv_pages = jnp.asarray(rng.standard_normal((pages, 4, 2 * num_kv * head_dim)), dtype)
  slots = rng.permutation(pages * 4 + 1)[:tokens]
  return ((qkv, cos, sin, *weights), (kv_pages, jnp.asarray(slots, jnp.int32)),
          dict(num_heads=num_heads, num_kv_heads=num_kv))


def _check_prepare(case, *, atol, query_rows=None, **kw):
  args, cache, heads = case
  q, pages = prepare_qkv(*args, 1e-6, *cache, query_rows=query_rows, **heads, **kw)
  want_q, want_pages = prepare_reference(*args, 1e-6, *cache, **heads)
  if query_rows is not None:  # grouped by KV head, zero rows after each group
    tokens, num_heads, head_dim = want_q.shape
    num_kv = q.shape[1]
    group = num_heads // num_kv
    assert q.shape == (tokens, num_kv, query_rows, head_dim)
    assert not np.any(np.asarray(q[:, :, group:], np.float32))
    q = q[:, :, :group].reshape(want_q.shape)
  for g, w in ((q, want_q), (pages, want_pages)):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=atol, rtol=atol)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 5), num_kv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([8, 16, 64]),
       normed=st.booleans(), grouped=st.booleans())
def test_prepare_matches_the_reference(seed, tokens, num_kv, group, head_dim, normed, grouped):
  case = _prepare_case(np.random.default_rng(seed), tokens, num_kv * group, num_kv, head_dim,
                       jnp.float32, normed)
  _check_prepare(case, atol=1e-5, query_rows=query_rows(group) if grouped else None)


def test_prepare_bf16_rounds_like_the_reference():
  case = _prepare_case(np.random.default_rng(5), 3, 4, 1, 256, jnp.bfloat16)
  _check_prepare(case, atol=2e-2, query_rows=16)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_prepare_adds_up_partial_sums(dtype, atol, splits):
  """The q/k/v projection as the CUDA GEMV's float32 partial sums [S, T, W]: added up and
  rounded to the cache's dtype, then as the projection itself (the reference adds them up
  with XLA)."""
  rng = np.random.default_rng(7 + splits)
  (qkv, *rest), (kv_pages, slots), heads = _prepare_case(rng, 3, 4, 1, 64, dtype)
  parts = jnp.asarray(rng.standard_normal((splits, *qkv.shape)), jnp.float32)
  case = ((parts, *rest), (kv_pages, slots), heads)
  _check_prepare(case, atol=atol, query_rows=16)
  _check_prepare(case, atol=atol)
  with pytest.raises(ValueError, match="partial sums"):
    prepare_qkv(parts.astype(jnp.bfloat16), *rest, 1e-6, kv_pages, slots, **heads)


def test_grouped_query_feeds_the_pallas_attention():
  # The grouped, padded query gives the attention the same result as the plain one.
  rng = np.random.default_rng(6)
  args, cache, heads = _prepare_case(rng, 4, 4, 1, 16, jnp.float32)
  plain, _ = prepare_qkv(*args, 1e-6, *cache, **heads)
  grouped, _ = prepare_qkv(*args, 1e-6, *cache, query_rows=16, **heads)
  kv_pages = jnp.asarray(rng.standard_normal((9, 4, 2 * 16)), jnp.float32)
  table = jnp.asarray(rng.permutation(9)[:8].reshape(2, 4), jnp.int32)
  seq_ids, positions = jnp.array([0, 1, 1, -1]), jnp.array([3, 15, 7, 0])
  kw_attn = dict(window=None, softcap=None, scale=0.25)
  want = paged_decode_attention(plain, kv_pages, table, seq_ids, positions, **kw_attn)
  got = paged_decode_attention(grouped, kv_pages, table, seq_ids, positions, group=4, **kw_attn)
  np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(want)[:3], atol=1e-6)
  with pytest.raises(ValueError, match="needs group"):
    paged_decode_attention(grouped, kv_pages, table, seq_ids, positions, **kw_attn)


def test_prepare_lowers_to_one_triton_kernel_for_cuda():
  """Gemma 3 1B's attention shape (4 query heads, 1 KV head, 256 dims), bf16, batch 1."""
  shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (
      ((1, 6 * 256), jnp.bfloat16), ((1, 128), jnp.float32), ((1, 128), jnp.float32),
      ((256,), jnp.bfloat16), ((256,), jnp.bfloat16))]
  cache = [jax.ShapeDtypeStruct((4864, 16, 512), jnp.bfloat16),
           jax.ShapeDtypeStruct((1,), jnp.int32)]
  def lower(*args):
    return lower_for_cuda(lambda *a: prepare_qkv(*a[:5], 1e-6, *a[5:], num_heads=4,
                                                 num_kv_heads=1, query_rows=16,
                                                 interpret=False), *args)
  text = lower(*shapes, *cache)
  assert text.count(f"@{TRITON}") == 1
  assert "stablehlo.while" not in text
  # The cache is written in place: the kernel's second output is its last operand.
  assert "output_operand_alias<output_tuple_indices = [1], operand_index = 6," in text
  # The GEMV's 16 partial sums go in as they are: still one kernel, and no sum before it.
  parts = jax.ShapeDtypeStruct((16, 1, 6 * 256), jnp.float32)
  text = lower(parts, *shapes[1:], *cache)
  assert text.count(f"@{TRITON}") == 1 and "stablehlo.reduce" not in text


@pytest.mark.gpu
def test_compiled_kernel_matches_the_reference_on_the_gpu():
  """The Triton kernel at the Gemma 3 widths, one row and a batch, f32 and bf16."""
  require_gpu()
  rng = np.random.default_rng(4)
  for width in (640, 1152):
    for rows in (1, 64):
      _check(_case(rng, rows, width, jnp.float32), atol=1e-5, interpret=False)
      _check(_case(rng, rows, width, jnp.bfloat16), atol=1e-2, interpret=False)
  for dtype, atol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
    for tokens in (1, 64):
      case = _prepare_case(rng, tokens, 4, 1, 256, dtype)
      _check_prepare(case, atol=atol, query_rows=16, interpret=False)
      _check_prepare(case, atol=atol, interpret=False)
      (qkv, *rest), cache, heads = case  # the GEMV's 16 partial sums of the projection
      parts = jnp.asarray(rng.standard_normal((16, *qkv.shape)) * 0.5, jnp.float32)
      _check_prepare(((parts, *rest), cache, heads), atol=atol, query_rows=16,
                     interpret=False)
