"""bench/attention.py: the steps it builds (bench.step's rows, each sequence's pages its own),
the K/V bytes a layer must read, and a measured row whose output is the reference
attention's on the same values (the Pallas kernels through Pallas' interpreter here)."""
import jax.numpy as jnp
import numpy as np
import pytest

from bench import attention as A
from blink_jax.engine_config import KernelOptions
from blink_jax.model.config import get_config, tiny_config
from tests.oracles import paged_attention


def test_a_mixed_step_is_decode_rows_then_prompt_chunks():
  case = A.Case("mixed", 3, context=40, tokens=23, prompt=8, page_size=4)
  assert case.rows == 23 and case.seqs == 3 + 3  # 20 prompt rows: chunks of 8, 8, 4
  assert case.runs() == [(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 3, 8), (4, 11, 8), (5, 19, 4)]
  assert case.pages_per_seq == 11 and case.num_pages == 6 * 11 + 1  # 40 tokens, 4 a page
  # Global: 3 contexts of 40 and the chunks' 8 + 8 + 4 keys; a window of 16: 16 a decode
  # row, the chunks from position 0 all their keys.
  assert case.keys_read(None) == 3 * 40 + 20
  assert case.keys_read(16) == 3 * 16 + 20
  decode = A.Case("decode", 4, context=40, page_size=4)
  assert decode.name == "decode 4" and decode.keys_read(None) == 160


def test_copies_hold_the_asked_bytes():
  cfg = get_config("gemma3-1b")
  case = A.Case("decode", 16, context=1024)
  row = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # 1 KiB a key and value
  assert A.copies_for(case, row, 256) == 16  # 65 pages x 16 keys x 16 sequences: ~16 MiB
  assert A.copies_for(case, row, 0) == 1
  assert A.layer_counts(cfg) == {"local": 22, "global": 4}


def test_our_row_is_the_reference_attention():
  """A decode-sized and a mixed step through the Pallas kernels (the decode head, then the
  prefill kernel), at a sliding-window and a global layer: the output the loop times is
  the reference's on the same values."""
  cfg = tiny_config("gemma3")
  options = KernelOptions(attention="pallas", prefill="pallas", norm="pallas", decode_rows=8)
  for case in (A.Case("decode", 4, context=40, page_size=4),
               A.Case("mixed", 2, context=40, tokens=24, prompt=8, page_size=4)):
    for layer in ("local", "global"):
      row, out = A.measure(cfg, case, layer, "ours", steps=2, repeats=2, options=options)
      assert row["case"] == case.name and row["layer"] == layer and len(row["us_all"]) == 2
      assert row["us_median"] > 0 and row["kv_tb_per_s"] > 0
      assert "energy_per_layer_j" not in row  # no NVML counter off a GPU
      q, caches = A.inputs(cfg, case, 1)
      window = None if layer == "global" else cfg.sliding_window
      bf = lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)  # noqa: E731
      want = paged_attention(bf(q), bf(caches[0]), jnp.asarray(case.page_table),
                             case.seq_ids, case.positions, window=window,
                             softcap=cfg.attn_logit_softcap,
                             scale=cfg.query_pre_attn_scalar**-0.5)
      np.testing.assert_allclose(out, np.asarray(want), atol=3e-2, rtol=3e-2)
      again, _ = A.measure(cfg, case, layer, "ours", steps=1, repeats=1, options=options,
                           against=out)
      assert again["max_abs_diff"] == 0.0  # the same values, the same kernels


def test_kernel_settings_reach_the_kernels():
  """--prefill_configs R:W:S: a mixed step's attention (the decode head, then the prefill
  kernel) with the prefill kernel at those settings, the same output; --decode_configs
  P:W:S the decode kernel's of a decode step."""
  cfg = tiny_config("gemma3")
  options = KernelOptions(attention="pallas", prefill="pallas", norm="pallas", decode_rows=8)
  assert A.prefill_settings("128:8:3") == {"block_rows": 128, "num_warps": 8, "num_stages": 3,
                                           "splits": None, "pages_per_block": None}
  assert A.prefill_settings("64:4:2:2")["splits"] == 2
  assert A.prefill_settings("64:4:1:0:2")["pages_per_block"] == 2
  with pytest.raises(ValueError, match="A:W:S"):
    A.prefill_settings("64:4")
  with pytest.raises(ValueError, match="A:W:S"):
    A.decode_settings("0:4:1:2:2")
  attention, group = A.our_attention(cfg, 24, options, A.prefill_settings("32:4:3"))
  assert group is None and attention.keywords["rest_fn"].keywords["block_rows"] == 32
  case = A.Case("mixed", 2, context=40, tokens=24, prompt=8, page_size=4)
  base, out = A.measure(cfg, case, "local", "ours", steps=1, repeats=1, options=options)
  row, _ = A.measure(cfg, case, "local", "ours", steps=1, repeats=1, options=options,
                     config="32:4:3", against=out)
  assert row["variant"] == "ours 32:4:3" and base["variant"] == "ours"
  assert row["max_abs_diff"] < 1e-2
  row, _ = A.measure(cfg, case, "local", "ours", steps=1, repeats=1, options=options,
                     config="32:4:3:1", against=out)
  assert row["max_abs_diff"] < 1e-2
  attention, _ = A.our_attention(cfg, 24, options, A.prefill_settings("32:4:1:0:1"))
  assert attention.keywords["rest_fn"].keywords["pages_per_block"] == 1
  row, _ = A.measure(cfg, case, "local", "ours", steps=1, repeats=1, options=options,
                     config="32:4:1:0:1", against=out)
  assert row["max_abs_diff"] < 1e-2
  assert A.decode_settings("0:8:3") == {"pages_per_block": None, "num_warps": 8,
                                         "num_stages": 3, "splits": None}
  attention, group = A.our_attention(cfg, 4, options, A.decode_settings("2:4:2"))
  assert group == 2 and attention.keywords["pages_per_block"] == 2
  decode = A.Case("decode", 4, context=40, page_size=4)
  _, out = A.measure(cfg, decode, "global", "ours", steps=1, repeats=1, options=options)
  row, _ = A.measure(cfg, decode, "global", "ours", steps=1, repeats=1, options=options,
                     config="2:4:2", against=out)
  assert row["variant"] == "ours 2:4:2" and row["max_abs_diff"] < 1e-2
