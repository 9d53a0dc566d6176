"""The merge of the attention's splits fused into the output projection
(`pallas_out.merge_out_project`) equals the merged attention times the output weights
(`Attention.out`); Pallas' interpreter on CPU, the compiled kernel on the GPU (`gpu`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from blink_jax import pallas_out
from blink_jax.model import sum_partials
from blink_jax.pallas_attention import paged_decode_attention
from blink_jax.pallas_out import merge_out_project
from tests.cuda_lowering import check_triton_calls, lower_for_cuda, require_gpu

ATTN = dict(window=None, softcap=None, scale=0.125)


def _case(rng, tokens, num_kv, group, head_dim, width, dtype, splits):
  """(the attention's splits, its merged output [T, H, h], the output weights [H, h, D])."""
  num_heads = num_kv * group
  q = jnp.asarray(rng.standard_normal((tokens, num_heads, head_dim)), dtype)
  kv = jnp.asarray(rng.standard_normal((9, 4, 2 * num_kv * head_dim)), dtype)
  table = jnp.asarray(rng.permutation(9)[:8].reshape(2, 4), jnp.int32)
  seq_ids = jnp.asarray(rng.integers(0, 2, tokens), jnp.int32)
  positions = jnp.asarray(rng.integers(0, 16, tokens), jnp.int32)
  args = (q, kv, table, seq_ids, positions)
  merged = paged_decode_attention(*args, splits=splits, **ATTN)
  parts = paged_decode_attention(*args, splits=splits, merged=False, **ATTN)
  w = jnp.asarray(rng.standard_normal((num_heads, head_dim, width)) * 0.05, dtype)
  return parts, merged, w


def _check(parts, merged, w, *, group, atol, **kw):
  tokens, num_heads, head_dim = merged.shape
  want = merged.reshape(tokens, -1) @ w.reshape(num_heads * head_dim, -1)
  sums = merge_out_project(parts, w, merged.dtype, group=group, **kw)
  assert sums.dtype == jnp.float32 and sums.shape[1:] == want.shape
  got = sum_partials(sums, want)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=atol, rtol=atol)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, pallas_out.MAX_TOKENS),
       num_kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([16, 64]), width=st.sampled_from([32, 128]),
       splits=st.sampled_from([1, 2, 4]))
def test_matches_the_merged_attention_times_the_weights(seed, tokens, num_kv, group,
                                                          head_dim, width, splits):
  case = _case(np.random.default_rng(seed), tokens, num_kv, group, head_dim, width,
               jnp.float32, splits)
  _check(*case, group=group, atol=1e-5)


def test_bf16_rounds_like_the_attention_output():
  case = _case(np.random.default_rng(1), 3, 1, 4, 64, 128, jnp.bfloat16, 4)
  _check(*case, group=4, atol=3e-2)


def test_rejects_what_it_cannot_run():
  parts, merged, w = _case(np.random.default_rng(2), 2, 1, 4, 16, 32, jnp.float32, 2)
  with pytest.raises(ValueError, match="do not match"):
    merge_out_project(parts, w[:3], jnp.float32, group=4)  # 3 heads for a group of 4
  with pytest.raises(ValueError, match="do not match"):
    merge_out_project(parts, w, jnp.float32, group=2)
  assert pallas_out.usable(1, 4, 256, 1152) and pallas_out.usable(8, 4, 256, 640)
  assert not pallas_out.usable(9, 4, 256, 1152)
  assert not pallas_out.usable(1, 3, 64, 1152)  # 3 blocks: not a power of two


def test_lowers_to_one_triton_kernel_for_cuda():
  """Gemma 3 1B's attention output (4 query heads on 1 KV head, 256 dims, 32 splits) into
  its 1152-wide projection, bf16, batch 1: one Triton call over 9 column slices x 16
  blocks of head dims."""
  shapes = [(jax.ShapeDtypeStruct((32, 1, 1, 16, 256), jnp.float32),
             jax.ShapeDtypeStruct((32, 1, 1, 16), jnp.float32),
             jax.ShapeDtypeStruct((32, 1, 1, 16), jnp.float32)),
            jax.ShapeDtypeStruct((4, 256, 1152), jnp.bfloat16)]
  text = lower_for_cuda(lambda p, w: merge_out_project(p, w, jnp.bfloat16, group=4,
                                                       interpret=False), *shapes)
  check_triton_calls(text, 1, (9, 16, 1))


@pytest.mark.gpu
def test_compiled_kernel_matches_on_the_gpu():
  require_gpu()
  rng = np.random.default_rng(3)
  with jax.default_matmul_precision("highest"):  # the f32 reference, not TF32
    for tokens in (1, 8):
      for dtype, atol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
        case = _case(rng, tokens, 1, 4, 256, 1152, dtype, 16)
        _check(*case, group=4, atol=atol, interpret=False)
