"""Model layer: the ragged paged forward against the dense oracle, the dense oracle against HF
transformers, the parameter tree round trip and bf16."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from blink_jax.model.config import tiny_config
from blink_jax.model.gemma import Gemma, init_kv_cache

# Gemma 3 with linear RoPE scaling on global layers (as 4B+); Gemma 2 with soft-caps small enough
# to bend random-weight logits (the real 50 / 30 would be the identity here).
CONFIGS = {
    "gemma3": tiny_config("gemma3", rope_scale_global=8.0),
    "gemma2": tiny_config("gemma2", attn_logit_softcap=2.0, final_logit_softcap=3.0),
}
assert all(c.sliding_window == 8 for c in CONFIGS.values())  # the lengths below cross it

NUM_SLOTS = 4
SLOT_CAPACITY = 48  # tokens per sequence slot; also the dense oracle's length
T_PAD = 64  # rows per paged step (unused rows are padding)


@functools.cache
def f32_model(family: str) -> Gemma:
  return Gemma(CONFIGS[family], dtype=jnp.float32, rngs=nnx.Rngs(1))


@functools.cache
def dense_logits(family: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Random tokens [NUM_SLOTS, SLOT_CAPACITY] and their dense-forward logits."""
  cfg = CONFIGS[family]
  tokens = np.random.RandomState(seed).randint(0, cfg.vocab_size, (NUM_SLOTS, SLOT_CAPACITY))
  logits = jax.jit(lambda m, t: m.dense_forward(t))(f32_model(family), jnp.asarray(tokens))
  return tokens, np.asarray(logits)


@functools.partial(jax.jit, static_argnums=0)
def paged_step(graphdef, state, tokens, positions, seq_ids, page_table, kv_cache):
  """One forward step through nnx.split/merge, as the executor runs it; logits of every row."""
  model = nnx.merge(graphdef, state)
  hidden, kv_cache = model.forward(tokens, positions, seq_ids, page_table, kv_cache)
  return model.logits(hidden), kv_cache


def shuffled_page_table(rng: np.random.RandomState, page_size: int) -> tuple[np.ndarray, int]:
  """Non-contiguous, shuffled page ids per slot; one extra garbage entry (-1 or past the end)
  per slot, which must never be read or written for a valid position."""
  pages_per_slot = math.ceil(SLOT_CAPACITY / page_size)
  num_pages = NUM_SLOTS * pages_per_slot + 3  # a few never-used pages
  ids = rng.permutation(num_pages)[:NUM_SLOTS * pages_per_slot]
  garbage = rng.choice([-1, num_pages, num_pages + 7], size=(NUM_SLOTS, 1))
  return np.concatenate([ids.reshape(NUM_SLOTS, pages_per_slot), garbage], axis=1), num_pages


def prefill_then_decode(rng, lengths):
  """Step 0 prefills every prompt at once; then one decode token per sequence per step."""
  decode = 6
  steps = [[(s, 0, n - decode) for s, n in enumerate(lengths)]]
  for i in range(decode):
    steps.append([(s, n - decode + i, 1) for s, n in enumerate(lengths)])
  return steps


def chunked_mixed(rng, lengths):
  """Sequences start at different steps and advance by random chunks of 1..7 tokens, so
  chunked prefill and single-token decodes of other sequences share steps."""
  start_step = [0, 0, 2, 3]
  done = [0] * len(lengths)
  steps = []
  while any(d < n for d, n in zip(done, lengths)):
    step = []
    for s, n in enumerate(lengths):
      if len(steps) >= start_step[s] and done[s] < n:
        take = min(n - done[s], int(rng.randint(1, 8)))
        step.append((s, done[s], take))
        done[s] += take
    steps.append(step)
  return steps


def run_paged(family, page_size, schedule, lengths, seed=0, model=None, dtype=jnp.float32):
  """Runs `schedule` (steps of (slot, start, count) chunks) through the paged forward in a
  random row order with padding rows; returns the logits of every valid row as
  {(slot, position): logits} and the dense tokens used."""
  cfg = CONFIGS[family]
  model = f32_model(family) if model is None else model
  tokens, _ = dense_logits(family, seed)
  rng = np.random.RandomState(seed + 100)
  page_table, num_pages = shuffled_page_table(rng, page_size)
  kv_cache = init_kv_cache(cfg, num_pages, page_size, dtype)
  graphdef, state = nnx.split(model)
  out = {}
  for step in schedule(rng, lengths):
    rows = [(s, p) for s, start, n in step for p in range(start, start + n)]
    assert len(rows) <= T_PAD
    # Padding rows: seq -1, arbitrary tokens and positions, scattered among the valid rows.
    order = rng.permutation(T_PAD)
    seq_ids = np.full(T_PAD, -1, np.int32)
    positions = rng.randint(0, 100, T_PAD).astype(np.int32)
    step_tokens = rng.randint(0, cfg.vocab_size, T_PAD).astype(np.int32)
    for row, (s, p) in zip(order, rows):
      seq_ids[row], positions[row], step_tokens[row] = s, p, tokens[s, p]
    logits, kv_cache = paged_step(graphdef, state, step_tokens, positions, seq_ids, page_table,
                                  kv_cache)
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()  # padding rows included
    for row, key in zip(order, rows):
      out[key] = logits[row]
  return out


def assert_close_to_dense(family, paged, seed=0, rtol=1e-4, atol=1e-4):
  _, dense = dense_logits(family, seed)
  keys = sorted(paged)
  got = np.stack([paged[k] for k in keys])
  want = np.stack([dense[s, p] for s, p in keys])
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


LENGTHS = [9, 13, 40, 21]  # 83 tokens; two sequences cross the window of 8 well past it


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("schedule", [prefill_then_decode, chunked_mixed])
def test_paged_forward_matches_dense(family, page_size, schedule):
  paged = run_paged(family, page_size, schedule, LENGTHS)
  assert len(paged) == sum(LENGTHS)
  assert_close_to_dense(family, paged)


def test_padding_rows_write_nothing():
  cfg = CONFIGS["gemma3"]
  model = f32_model("gemma3")
  kv_cache = [kv + 1.0 for kv in init_kv_cache(cfg, 8, 4, jnp.float32)]
  page_table = np.arange(8, dtype=np.int32).reshape(2, 4)
  hidden, new_cache = jax.jit(lambda m, *a: m.forward(*a))(
      model, jnp.array([3, 7, 9], jnp.int32), jnp.array([0, 5, 15], jnp.int32),
      jnp.full(3, -1, jnp.int32), page_table, kv_cache)
  assert np.isfinite(np.asarray(hidden)).all()
  for kv, kv2 in zip(kv_cache, new_cache):
    np.testing.assert_array_equal(kv, kv2)


def test_forward_inside_while_loop():
  """Decode steps of one sequence inside lax.fori_loop with the model merged in the body."""
  family, page_size, prompt, decode = "gemma2", 4, 10, 5
  cfg = CONFIGS[family]
  tokens, dense = dense_logits(family, 0)
  graphdef, state = nnx.split(f32_model(family))
  page_table = jnp.asarray(np.random.RandomState(0).permutation(16)[:12].reshape(1, 12))
  seq = jnp.asarray(tokens[0], jnp.int32)

  @jax.jit
  def run(state):
    model = nnx.merge(graphdef, state)
    cache = init_kv_cache(cfg, 16, page_size, jnp.float32)
    positions = jnp.arange(prompt, dtype=jnp.int32)
    _, cache = model.forward(seq[:prompt], positions, jnp.zeros(prompt, jnp.int32), page_table,
                             cache)

    def body(i, carry):
      cache, _ = carry
      pos = (prompt + i)[None]
      model = nnx.merge(graphdef, state)
      hidden, cache = model.forward(seq[pos], pos, jnp.zeros(1, jnp.int32), page_table, cache)
      return cache, model.logits(hidden)[0]

    return jax.lax.fori_loop(0, decode, body, (cache, jnp.zeros(cfg.vocab_size)))[1]

  last = run(state)
  np.testing.assert_allclose(last, dense[0, prompt + decode - 1], rtol=1e-4, atol=1e-4)


# -- HF transformers --------------------------------------------------------------------------


def hf_model(family, params):
  """HF Gemma3ForCausalLM / Gemma2ForCausalLM with our weights (eager attention, float32)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = CONFIGS[family]
  d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  common = dict(
      vocab_size=cfg.vocab_size, hidden_size=d, intermediate_size=cfg.ffw_hidden,
      num_hidden_layers=cfg.num_layers, num_attention_heads=n, num_key_value_heads=k,
      head_dim=h, max_position_embeddings=cfg.max_context, rms_norm_eps=cfg.rms_norm_eps,
      hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
      sliding_window=cfg.sliding_window, final_logit_softcapping=cfg.final_logit_softcap,
      attn_logit_softcapping=cfg.attn_logit_softcap, tie_word_embeddings=True,
      layer_types=["full_attention" if cfg.is_global(i) else "sliding_attention"
                   for i in range(cfg.num_layers)],
      attn_implementation="eager")
  if family == "gemma3":
    assert cfg.rope_scale_global != 1.0
    rope = {"full_attention": {"rope_type": "linear", "factor": cfg.rope_scale_global,
                               "rope_theta": cfg.rope_base_global},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base_local}}
    hf_cfg = transformers.Gemma3TextConfig(rope_parameters=rope, **common)
    model = transformers.Gemma3ForCausalLM(hf_cfg)
  else:
    assert cfg.rope_base_global == cfg.rope_base_local  # Gemma 2: one RoPE
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base_local}
    hf_cfg = transformers.Gemma2Config(rope_parameters=rope, **common)
    model = transformers.Gemma2ForCausalLM(hf_cfg)

  t = lambda a: torch.from_numpy(np.array(a, np.float32))
  sd = {"model.embed_tokens.weight": t(params["embed"]),
        "lm_head.weight": t(params["embed"]),
        "model.norm.weight": t(params["final_norm"])}
  for i in range(cfg.num_layers):
    p, pre = params["layers"][str(i)], f"model.layers.{i}."
    a, m = p["attn"], p["mlp"]
    sd |= {pre + "input_layernorm.weight": t(p["pre_attn_norm"]),
           pre + "post_attention_layernorm.weight": t(p["post_attn_norm"]),
           pre + "pre_feedforward_layernorm.weight": t(p["pre_ffw_norm"]),
           pre + "post_feedforward_layernorm.weight": t(p["post_ffw_norm"]),
           # torch Linear stores [out, in]
           pre + "self_attn.q_proj.weight": t(np.reshape(a["q"], (d, n * h)).T),
           pre + "self_attn.k_proj.weight": t(np.reshape(a["k"], (d, k * h)).T),
           pre + "self_attn.v_proj.weight": t(np.reshape(a["v"], (d, k * h)).T),
           pre + "self_attn.o_proj.weight": t(np.reshape(a["o"], (n * h, d)).T),
           pre + "mlp.gate_proj.weight": t(np.asarray(m["gate"]).T),
           pre + "mlp.up_proj.weight": t(np.asarray(m["up"]).T),
           pre + "mlp.down_proj.weight": t(np.asarray(m["down"]).T)}
    if cfg.use_qk_norm:
      sd |= {pre + "self_attn.q_norm.weight": t(a["q_norm"]),
             pre + "self_attn.k_norm.weight": t(a["k_norm"])}
  missing, unexpected = model.load_state_dict(sd, strict=False)
  assert not unexpected and not missing, (missing, unexpected)
  return model.eval()


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_dense_forward_matches_hf(family):
  torch = pytest.importorskip("torch")
  model = f32_model(family)
  tokens = np.random.RandomState(5).randint(0, CONFIGS[family].vocab_size, (2, 24))  # > window
  ours = np.asarray(model.dense_forward(jnp.asarray(tokens)))
  with torch.no_grad():
    theirs = hf_model(family, model.to_params())(torch.from_numpy(tokens)).logits.numpy()
  scale = np.abs(theirs).max()
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * scale)


# -- parameter tree ---------------------------------------------------------------------------


def contract_shapes(cfg):
  """The parameter tree of docs/ARCHITECTURE.md, "Parameter tree", as {path: shape}."""
  d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffw_hidden
  shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,)}
  for i in range(cfg.num_layers):
    layer = {"pre_attn_norm": (d,), "post_attn_norm": (d,), "pre_ffw_norm": (d,),
             "post_ffw_norm": (d,), "attn/q": (d, n, h), "attn/k": (d, k, h),
             "attn/v": (d, k, h), "attn/o": (n, h, d), "mlp/gate": (d, f), "mlp/up": (d, f),
             "mlp/down": (f, d)}
    if cfg.use_qk_norm:
      layer |= {"attn/q_norm": (h,), "attn/k_norm": (h,)}
    shapes |= {f"layers/{i}/{name}": shape for name, shape in layer.items()}
  return shapes


def flat(tree, prefix=""):
  if not isinstance(tree, dict):
    return {prefix: tree}
  return {k2: v2 for k, v in tree.items() for k2, v2 in flat(v, f"{prefix}{k}/").items()}


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_params_round_trip(family):
  cfg = CONFIGS[family]
  model = Gemma(cfg, dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
  params = model.to_params()
  shapes = {k.rstrip("/"): tuple(v.shape) for k, v in flat(params).items()}
  assert shapes == contract_shapes(cfg)

  rebuilt = Gemma.from_params(cfg, params, dtype=jnp.float32)
  for key, value in flat(rebuilt.to_params()).items():
    assert value.dtype == jnp.bfloat16
    np.testing.assert_array_equal(value, flat(params)[key])
  tokens = jnp.arange(12, dtype=jnp.int32)[None]
  np.testing.assert_array_equal(rebuilt.dense_forward(tokens), model.dense_forward(tokens))

  bad = jax.tree.map(lambda x: x, params)
  bad["layers"]["1"]["mlp"]["up"] = jnp.zeros((cfg.d_model, cfg.ffw_hidden + 1))
  del bad["final_norm"]
  with pytest.raises(ValueError, match=r"missing final_norm.*layers/1/mlp/up: shape"):
    Gemma.from_params(cfg, bad)


# -- bf16 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_bf16_close_to_f32(family):
  cfg = CONFIGS[family]
  params = f32_model(family).to_params()
  bf16 = Gemma.from_params(cfg, params, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  assert bf16.to_params()["embed"].dtype == jnp.bfloat16
  tokens, dense = dense_logits(family, 0)
  ours = np.asarray(jax.jit(lambda m, t: m.dense_forward(t))(bf16, jnp.asarray(tokens)))
  assert ours.dtype == np.float32
  scale = np.abs(dense).max()
  assert np.abs(ours - dense).max() < 0.05 * scale
  # Same argmax for nearly all positions.
  assert (ours.argmax(-1) == dense.argmax(-1)).mean() > 0.9

  paged = run_paged(family, 4, prefill_then_decode, LENGTHS, model=bf16, dtype=jnp.bfloat16)
  assert_close_to_dense(family, paged, rtol=0, atol=0.05 * scale)
