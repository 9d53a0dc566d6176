"""Gemma 2 / Gemma 3 text model in Flax NNX.

One module serves both families: Gemma 3 adds QK RMSNorm, Gemma 2 adds attention-logit and
final-logit soft-capping; both alternate local (sliding-window) and global layers and differ in
the per-layer RoPE base/scale (all of it read from `ModelConfig`). The math follows
google-deepmind/gemma `gm/nn/_modules.py` and HF `modeling_gemma3.py`.

Parameters are NNX Params laid out exactly as the tree of docs/ARCHITECTURE.md, "Parameter
tree", so `to_params` /
`from_params` are a key conversion away from `nnx.state`. Layers are a plain (unrolled) list.

Two forwards share the layer stack (`Gemma._run_layers`) and differ only in attention:
`forward` is the ragged paged step of the serving engine, `dense_forward` a plain causal
forward over contiguous K/V that serves as its oracle. The stack is written as residual
steps that each end in the next norm (`add_rms_norm`: a layer's post-attention add and its
pre-FFW norm; its post-FFW add and the next layer's pre-attention norm), so a serving step
can run each pair as one fused kernel (`blink_jax.kernels.pallas_norm`).
"""
from __future__ import annotations

import math
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from blink_jax.model.attention import (MASK_VALUE, apply_softcap, cache_slots, kv_rows,
                                 paged_attention_reference, write_rows)
from blink_jax.model.config import ModelConfig

KVCache = list[jax.Array]  # per layer kv_pages [P, page, 2 * K * h]: keys, then values
AttentionFn = Callable[..., jax.Array]  # the signature of paged_attention_reference
AddNormFn = Callable[..., tuple[jax.Array, jax.Array]]  # the signature of add_rms_norm
FfwDownFn = Callable[..., jax.Array]  # the signature of MLP.down_project (without self)
LogitsFn = Callable[[jax.Array, jax.Array], jax.Array]  # (x [T, D], embed [V, D]) -> f32 [T, V]
OutFn = Callable[..., jax.Array]  # (attention output, o weights [H, h, D], dtype) -> branch
MatmulFn = Callable[[jax.Array, jax.Array], jax.Array]  # (x [T, K], w [K, N]) -> x @ w
PrepareFn = Callable[..., tuple[jax.Array, jax.Array]]  # the signature of prepare_qkv


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm with Gemma's (1 + w) scale, computed in float32, returned in x's dtype."""
  xf = x.astype(jnp.float32)
  normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def sum_partials(branch: jax.Array, x: jax.Array) -> jax.Array:
  """A branch [..., D] as is, or float32 partial sums of it [S, ..., D] (the CUDA GEMV's) added
  up and rounded to x's dtype (as the matmul they split would have been)."""
  if branch.ndim == x.ndim + 1:
    return branch.sum(axis=0).astype(x.dtype)
  return branch


def add_rms_norm(x: jax.Array, branch: jax.Array, add_weight: jax.Array,
                 next_weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
  """A residual step and the norm after it: x + rms_norm(branch, add_weight), and that sum
  normed with next_weight (the input of the next sub-block). branch [..., D], or float32
  partial sums [S, ..., D] of it (`cuda_gemv.ffw_down`), added up and rounded to x's dtype
  first."""
  x = x + rms_norm(sum_partials(branch, x), add_weight, eps)
  return x, rms_norm(x, next_weight, eps)


def rope_tables(positions: jax.Array, head_dim: int, base: float,
                scale: float) -> tuple[jax.Array, jax.Array]:
  """cos and sin [..., h/2] (float32) of the rotary angles at positions [...]: dimension i of
  the first half pairs with i + h/2 ("rotate_half", not the interleaved convention);
  `scale` divides positions (linear RoPE scaling)."""
  inv_freq = 1.0 / base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = (positions.astype(jnp.float32) / scale)[..., None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotary embedding of x [..., N, h] with `rope_tables` [..., h/2], in float32."""
  cos, sin = cos[..., None, :], sin[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def qk_norm_rope(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array,
                 q_weight: jax.Array | None, k_weight: jax.Array | None,
                 eps: float) -> tuple[jax.Array, jax.Array]:
  """q [..., H, h], k [..., K, h] -> both RMS-normed per head (Gemma 3; skipped when the
  weights are None) and rotated. Query and key heads go through as one [..., H + K, h] array:
  the same math per head, but one reduction and one elementwise kernel per layer instead of
  one each (a batch-1 step is bound by its kernel count: docs/NOTES.md, "Dot-strength
  reduction off")."""
  n, h = q.shape[-2:]
  qk = jnp.concatenate([q, k], axis=-2)
  if q_weight is not None:
    weight = jnp.concatenate([jnp.broadcast_to(q_weight, (n, h)),
                              jnp.broadcast_to(k_weight, (k.shape[-2], h))])
    qk = rms_norm(qk, weight, eps)
  qk = apply_rope(qk, cos, sin)
  return qk[..., :n, :], qk[..., n:, :]


def split_qkv(qkv: jax.Array, num_heads: int,
              num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The fused projection qkv [..., (H + 2K) * h] (`Attention.project`) -> q [..., H, h],
  k, v [..., K, h]."""
  head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
  heads = qkv.reshape(*qkv.shape[:-1], num_heads + 2 * num_kv_heads, head_dim)
  return (heads[..., :num_heads, :], heads[..., num_heads:num_heads + num_kv_heads, :],
          heads[..., num_heads + num_kv_heads:, :])


def prepare_qkv(qkv: jax.Array, cos: jax.Array, sin: jax.Array, q_weight: jax.Array | None,
                k_weight: jax.Array | None, eps: float, kv_pages: jax.Array, slots: jax.Array,
                *, num_heads: int, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
  """The fused projection of a ragged step, qkv [T, (H + 2K) * h] (or float32 partial sums of
  it [S, T, (H + 2K) * h], added up and rounded to the cache's dtype) -> the attention's
  query [T, H, h] (`qk_norm_rope`) and the cache kv_pages with each token's row (keys, then
  values) written at its `attention.cache_slots` slot."""
  if qkv.ndim == 3:
    qkv = qkv.sum(axis=0).astype(kv_pages.dtype)
  q, k, v = split_qkv(qkv, num_heads, num_kv_heads)
  q, k = qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps)
  return q, write_rows(kv_pages, kv_rows(k, v), slots)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype: Any) -> nnx.Param:
  return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _norm_weight(rngs: nnx.Rngs, dim: int, dtype: Any) -> nnx.Param:
  # Random rather than zero (the trained init) so tests exercise the 1 + w convention.
  return _normal(rngs, (dim,), 0.1, dtype)


class Attention(nnx.Module):
  """Projections, QK norm and RoPE of one layer, plus its static attention settings."""

  def __init__(self, cfg: ModelConfig, layer: int, *, param_dtype: Any, rngs: nnx.Rngs):
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q = _normal(rngs, (d, n, h), d**-0.5, param_dtype)
    self.k = _normal(rngs, (d, k, h), d**-0.5, param_dtype)
    self.v = _normal(rngs, (d, k, h), d**-0.5, param_dtype)
    self.o = _normal(rngs, (n, h, d), (n * h)**-0.5, param_dtype)
    # The head counts and size as static fields, not read off q and k: a serving loop that
    # holds only their fused copy (the executor) passes placeholders for them.
    self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
    self.use_qk_norm = cfg.use_qk_norm
    if cfg.use_qk_norm:
      self.q_norm = _norm_weight(rngs, h, param_dtype)
      self.k_norm = _norm_weight(rngs, h, param_dtype)
    self.eps = cfg.rms_norm_eps
    self.rope_base, self.rope_scale = cfg.rope(layer)
    self.window = cfg.window(layer)
    self.softcap = cfg.attn_logit_softcap
    self.scale = cfg.query_pre_attn_scalar**-0.5

  def attention_kwargs(self) -> dict[str, Any]:
    """The keyword arguments of an attention function for this layer."""
    return dict(window=self.window, softcap=self.softcap, scale=self.scale)

  def project(self, x: jax.Array, fused: jax.Array | None = None,
              matmul_fn: MatmulFn | None = None) -> jax.Array:
    """x [..., D] -> the fused projection [..., (H + 2K) * h]: q, k, v heads (before norms
    and RoPE) side by side, `split_qkv` parts them. One matmul over the concatenated weights
    (`fused`, from `qkv_weight`, made once by the executor; else concatenated here), so a
    kernel that takes the projection reads it in place: three separate outputs made XLA
    copy each slice of its merged matmul into a buffer of its own. A 2-D matmul: at one row
    XLA's GPU backend compiled a 3-D einsum to a multiply that wrote the whole weight-sized
    product, then a reduce (docs/NOTES.md, "Batch-1 decode is bound by kernel count").
    matmul_fn: that matmul (default
    `@`; it may return float32 partial sums [S, ..., N] for a prepare function that adds
    them up)."""
    w = (self.qkv_weight() if fused is None else fused).astype(x.dtype)
    return x @ w if matmul_fn is None else matmul_fn(x, w)

  def qkv_weight(self) -> jax.Array:
    """The q, k and v weights side by side, [D, (H + 2K) * h]."""
    d = self.q.shape[0]
    return jnp.concatenate([w[...].reshape(d, -1) for w in (self.q, self.k, self.v)], axis=1)

  def heads(self) -> dict[str, int]:
    """The head counts `split_qkv` and the prepare functions take."""
    return dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)

  def rope_tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """This layer's RoPE cos and sin at positions (its base and scale)."""
    return rope_tables(positions, self.head_dim, self.rope_base, self.rope_scale)

  def norm_weights(self) -> tuple[jax.Array | None, jax.Array | None]:
    """The q and k RMSNorm weights (Gemma 3), or None twice (Gemma 2)."""
    if not self.use_qk_norm:
      return None, None
    return self.q_norm[...], self.k_norm[...]

  def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., D] -> q [..., H, h], k, v [..., K, h]; q and k normed (Gemma 3) and rotated."""
    q, k, v = split_qkv(self.project(x), **self.heads())
    q, k = qk_norm_rope(q, k, *self.rope_tables(positions), *self.norm_weights(), self.eps)
    return q, k, v

  def out(self, attn: jax.Array) -> jax.Array:
    """attn [..., H, h] -> [..., D]."""
    n, h, d = self.o.shape
    flat = attn.reshape(*attn.shape[:-2], n * h)
    return flat @ self.o[...].astype(attn.dtype).reshape(n * h, d)


class MLP(nnx.Module):
  """GeGLU feed-forward: down(gelu_tanh(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, param_dtype: Any, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.ffw_hidden
    self.gate = _normal(rngs, (d, f), d**-0.5, param_dtype)
    self.up = _normal(rngs, (d, f), d**-0.5, param_dtype)
    self.down = _normal(rngs, (f, d), f**-0.5, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_project(self.gate_up(x), self.down[...])

  def gate_up(self, x: jax.Array, fused: jax.Array | None = None,
              matmul_fn: MatmulFn | None = None) -> jax.Array:
    """x [..., D] -> the fused gate/up projection [..., 2F] (gate, then up): one matmul over
    the concatenated weights (`fused`, from `gate_up_weight`, as for `Attention.project`),
    so a kernel can take it in place. matmul_fn: that matmul (default `@`)."""
    w = (self.gate_up_weight() if fused is None else fused).astype(x.dtype)
    return x @ w if matmul_fn is None else matmul_fn(x, w)

  def gate_up_weight(self) -> jax.Array:
    """The gate and up weights side by side, [D, 2F]."""
    return jnp.concatenate([self.gate[...], self.up[...]], axis=1)

  @staticmethod
  def activate(gate_up: jax.Array) -> jax.Array:
    """The fused gate/up projection [..., 2F] -> gelu_tanh(gate) * up [..., F], in its dtype
    (what the down projection multiplies)."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.gelu(gate, approximate=True) * up

  @staticmethod
  def down_project(gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """The fused gate/up projection [..., 2F] and the down weights [F, D] -> the MLP's
    output down(gelu_tanh(gate) * up) [..., D]."""
    return MLP.activate(gate_up) @ down.astype(gate_up.dtype)


class Block(nnx.Module):
  """One decoder layer's weights; `Gemma._run_layers` runs it around the attention."""

  def __init__(self, cfg: ModelConfig, layer: int, *, param_dtype: Any, rngs: nnx.Rngs):
    d = cfg.d_model
    self.pre_attn_norm = _norm_weight(rngs, d, param_dtype)
    self.post_attn_norm = _norm_weight(rngs, d, param_dtype)
    self.pre_ffw_norm = _norm_weight(rngs, d, param_dtype)
    self.post_ffw_norm = _norm_weight(rngs, d, param_dtype)
    self.attn = Attention(cfg, layer, param_dtype=param_dtype, rngs=rngs)
    self.mlp = MLP(cfg, param_dtype=param_dtype, rngs=rngs)
    self.eps = cfg.rms_norm_eps

  def ffw(self, x: jax.Array, attn: Any, kernels: "StepKernels",
          gate_up: jax.Array | None = None,
          tp_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Residual stream and attention output [..., H, h] -> the residual stream after the
    attention and the MLP's output (before its post-FFW norm and add; `kernels.ffw_down` may
    hand it as partial sums, see `add_rms_norm`). gate_up: `MLP.gate_up_weight`, if made
    already. `kernels.out_project` projects the attention's output instead of
    `Attention.out`, maybe as partial sums. tp_axis: the weights are a shard of the heads and
    of the hidden dimension; the output projection is summed over that axis here, the MLP's
    by the caller."""
    branch = (self.attn.out(attn) if kernels.out_project is None
              else kernels.out_project(attn, self.attn.o[...], x.dtype))
    if tp_axis is not None:
      branch = lax.psum(branch, tp_axis)
    x, y = kernels.add_norm(x, branch, self.post_attn_norm[...], self.pre_ffw_norm[...],
                            self.eps)
    return x, kernels.ffw_down(self.mlp.gate_up(y, gate_up, kernels.gate_up_matmul),
                               self.mlp.down[...])

  # The weights `fused_weights` concatenates, as (sub-module, name): a forward given `fused`
  # reads none of them, so a serving loop holds only the fused copies.
  FUSED_AWAY = (("attn", "q"), ("attn", "k"), ("attn", "v"), ("mlp", "gate"), ("mlp", "up"))

  def fused_weights(self) -> tuple[jax.Array, jax.Array]:
    """(`Attention.qkv_weight`, `MLP.gate_up_weight`): what `Gemma.forward` takes as
    `fused`."""
    return self.attn.qkv_weight(), self.mlp.gate_up_weight()


class Gemma(nnx.Module):
  """Gemma 2 / 3 decoder-only text model (see the module docstring)."""

  def __init__(self, cfg: ModelConfig, *, dtype: Any = jnp.bfloat16, param_dtype: Any = None,
               rngs: nnx.Rngs | None = None):
    """Random init (normal; for tests). `dtype`: activations and KV cache; `param_dtype`:
    stored weights (defaults to `dtype`); `rngs` defaults to nnx.Rngs(0)."""
    rngs = nnx.Rngs(0) if rngs is None else rngs
    param_dtype = dtype if param_dtype is None else param_dtype
    self.cfg = cfg
    self.dtype = jnp.dtype(dtype)
    # Tensor parallelism (docs/ARCHITECTURE.md, "Tensor parallelism (design)"): the mesh axis
    # this model's weights are split over inside a shard_map (model/tensor_parallel.py), or
    # None. With it the weights are one device's shard and the forward adds the collectives.
    self.tp_axis: str | None = None
    self.embed = _normal(rngs, (cfg.vocab_size, cfg.d_model), cfg.d_model**-0.5, param_dtype)
    self.final_norm = _norm_weight(rngs, cfg.d_model, param_dtype)
    self.layers = nnx.List(
        [Block(cfg, i, param_dtype=param_dtype, rngs=rngs) for i in range(cfg.num_layers)])

  # -- parameter tree (docs/ARCHITECTURE.md, "Parameter tree") ----------------------------

  def to_params(self) -> dict[str, Any]:
    """The nested-dict parameter tree (docs/ARCHITECTURE.md, "Parameter tree"; layer keys "0",
    "1", ...)."""
    return _str_keys(nnx.to_pure_dict(nnx.state(self, nnx.Param)))

  @classmethod
  def from_params(cls, cfg: ModelConfig, params: dict[str, Any], *, dtype: Any = jnp.bfloat16,
                  param_dtype: Any = None) -> "Gemma":
    """Builds the model around an existing tree (the inverse of `to_params`).

    Arrays are kept as given (no copy, no cast) unless `param_dtype` is set. Raises ValueError
    naming every missing, unexpected or mis-shaped entry.
    """
    model = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    expected = _flatten(_str_keys(nnx.to_pure_dict(state)))
    given = _flatten(params)
    errors = [f"missing {k} {v.shape}" for k, v in expected.items() if k not in given]
    errors += [f"unexpected {k}" for k in given if k not in expected]
    errors += [f"{k}: shape {tuple(given[k].shape)}, expected {v.shape}"
               for k, v in expected.items() if k in given and tuple(given[k].shape) != v.shape]
    if errors:
      raise ValueError(f"parameter tree does not fit {cfg.name}: " + "; ".join(errors))
    convert = jnp.asarray if param_dtype is None else (lambda a: jnp.asarray(a, param_dtype))
    nnx.replace_by_pure_dict(state, _int_keys(jax.tree.map(convert, params)))
    nnx.update(model, state)
    return model

  # -- forwards ----------------------------------------------------------------------------

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """tokens [...] -> [..., D]: rows of the embedding times sqrt(D), both in the activation
    dtype first (as the references do: in bf16, sqrt(D) itself is rounded)."""
    if self.tp_axis is None:
      x = jnp.take(self.embed[...], tokens, axis=0, mode="clip").astype(self.dtype)
    else:  # this device's vocabulary rows: the others' tokens give zeros, summed over tp
      rows = self.embed.shape[0]
      local = tokens - lax.axis_index(self.tp_axis) * rows
      mine = (local >= 0) & (local < rows)
      x = jnp.take(self.embed[...], jnp.clip(local, 0, rows - 1), axis=0).astype(self.dtype)
      x = lax.psum(jnp.where(mine[..., None], x, jnp.zeros((), x.dtype)), self.tp_axis)
    return x * jnp.asarray(math.sqrt(self.cfg.d_model), self.dtype)

  def forward(self, tokens: jax.Array, positions: jax.Array, seq_ids: jax.Array,
              page_table: jax.Array, kv_cache: KVCache, kernels: "StepKernels | None" = None,
              fused: Sequence[tuple[jax.Array, jax.Array]] | None = None,
              window_pages: int = 0, local_only: jax.Array | None = None
              ) -> tuple[jax.Array, KVCache]:
    """One ragged paged step (docs/ARCHITECTURE.md, "Ragged paged forward"): tokens, positions,
    seq_ids [T] int32,
    page_table [S, max_pages]. Every token writes its K/V, then attends to its sequence.

    Returns the final hidden states [T, D] (before the final norm; see `logits`) and the new
    caches. kernels: the functions the step runs (`StepKernels`; default the jnp reference
    math; `blink_jax.kernels.select` picks faster ones). fused: each layer's
    `Block.fused_weights`, made once by the caller (the executor does, so no step
    concatenates weights; without them every step does, which inside the serving loop XLA
    hoists but a host-driven step cannot).
    window_pages: windowed pages (docs/ARCHITECTURE.md, "Windowed pages"): the sliding-window
    layers' caches are rings of that many pages per sequence (`init_kv_cache`), read and
    written through `ring_page_table`; 0: every layer's cache is paged by page_table.
    local_only [T]: rows (nonzero) whose K/V only the sliding-window layers write: the
    scheduler's recompute of tokens whose global-layer K/V lie in shared cached pages.
    """
    kernels = REFERENCE_KERNELS if kernels is None else kernels
    if len(kv_cache) != len(self.layers):
      raise ValueError(f"{len(kv_cache)} KV caches for {len(self.layers)} layers")
    new_cache = []
    tables = {}  # (base, scale) -> cos, sin: computed once per step, not once per layer
    glob = next(i for i in range(len(self.layers)) if self.cfg.is_global(i)) \
        if window_pages else 0
    slots = cache_slots(page_table, seq_ids, positions, *kv_cache[glob].shape[:2])
    if local_only is not None:  # one past the end: the write is dropped
      slots = jnp.where(local_only != 0, kv_cache[glob].shape[0] * kv_cache[glob].shape[1],
                        slots)
    tables_of = lambda i: (page_table, slots)  # noqa: E731
    if window_pages:
      ring = ring_page_table(page_table.shape[0], page_table.shape[1], window_pages)
      local = (ring, cache_slots(ring, seq_ids, positions, page_table.shape[0] * window_pages,
                                 kv_cache[glob].shape[1]))
      tables_of = lambda i: (page_table, slots) if self.cfg.is_global(i) else local  # noqa: E731

    def attend(i, layer, y):
      attn = layer.attn
      table, layer_slots = tables_of(i)
      key = (attn.rope_base, attn.rope_scale)
      if key not in tables:
        tables[key] = attn.rope_tables(positions)
      qkv = attn.project(y, None if fused is None else fused[i][0], kernels.qkv_matmul)
      q, kv_pages = kernels.prepare(qkv, *tables[key], *attn.norm_weights(), attn.eps,
                                    kv_cache[i], layer_slots, **attn.heads())
      new_cache.append(kv_pages)
      return kernels.attention(q, kv_pages, table, seq_ids, positions,
                               **attn.attention_kwargs())
    x = self._run_layers(self.embed_tokens(tokens), attend, kernels,
                         None if fused is None else [f[1] for f in fused])
    return x, new_cache

  def fused_weights(self) -> list[tuple[jax.Array, jax.Array]]:
    """Each layer's `Block.fused_weights`, for `forward(fused=...)`."""
    return [layer.fused_weights() for layer in self.layers]

  def _run_layers(self, x: jax.Array, attend: Callable[..., jax.Array],
                  kernels: "StepKernels",
                  gate_ups: Sequence[jax.Array] | None = None) -> jax.Array:
    """The decoder stack over embedded tokens x [..., D]; attend(i, layer, y) -> the
    attention output of layer i for its normed input y. Returns the final residual stream
    (before the final norm)."""
    eps = self.cfg.rms_norm_eps
    layers = list(self.layers)
    y = rms_norm(x, layers[0].pre_attn_norm[...], eps)
    for i, layer in enumerate(layers):
      x, h = layer.ffw(x, attend(i, layer, y), kernels,
                       None if gate_ups is None else gate_ups[i], self.tp_axis)
      if self.tp_axis is not None:  # the down projection's sum over the hidden shards
        h = lax.psum(h, self.tp_axis)
      if i + 1 < len(layers):
        x, y = kernels.add_norm(x, h, layer.post_ffw_norm[...],
                                layers[i + 1].pre_attn_norm[...], eps)
      else:
        x = x + rms_norm(sum_partials(h, x), layer.post_ffw_norm[...], eps)
    return x

  def logits(self, hidden: jax.Array, logits_fn: "LogitsFn | None" = None) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V]: final norm, tied head, final softcap.
    logits_fn: the tied head's matmul (`StepKernels.logits`; default the einsum)."""
    x = rms_norm(hidden, self.final_norm[...], self.cfg.rms_norm_eps)
    if logits_fn is None:
      logits = jnp.einsum("...d,vd->...v", x, self.embed[...].astype(x.dtype),
                          preferred_element_type=jnp.float32)
    else:
      logits = logits_fn(x, self.embed[...])
    if self.tp_axis is not None:  # each device's vocabulary shard, in vocabulary order
      logits = lax.all_gather(logits, self.tp_axis, axis=logits.ndim - 1, tiled=True)
    return apply_softcap(logits, self.cfg.final_logit_softcap)

  def dense_forward(self, tokens: jax.Array) -> jax.Array:
    """Plain causal forward of tokens [B, L] from position 0 -> float32 logits [B, L, V]."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    def attend(i, layer, y):
      return dense_attention(*layer.attn.qkv(y, positions), **layer.attn.attention_kwargs())
    x = self._run_layers(self.embed_tokens(tokens), attend, REFERENCE_KERNELS)
    return self.logits(x)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None,
                    softcap: float | None, scale: float) -> jax.Array:
  """Causal GQA attention over contiguous q [B, L, H, h], k, v [B, L, K, h] -> [B, L, H, h]."""
  b, length, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  q = q.reshape(b, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
  logits = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
  logits = apply_softcap(logits, softcap)
  q_pos = jnp.arange(length)[:, None]
  k_pos = jnp.arange(length)[None, :]
  mask = k_pos <= q_pos
  if window is not None:
    mask &= q_pos - k_pos < window  # HF: kv_idx > q_idx - sliding_window
  logits = jnp.where(mask, logits, MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgqs,bskh->bqkgh", probs, v)
  return out.reshape(b, length, num_heads, head_dim)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int,
                  dtype: Any = jnp.bfloat16, *, ring_pages: int = 0) -> KVCache:
  """Zeroed per-layer kv_pages [num_pages, page_size, 2 * K * h]: a row holds a token's keys
  (K heads side by side), then its values, so writing a token is one contiguous row. Heads
  share the last axis: with a [.., K, h] shape and K == 1 (Gemma 3 270M and 1B) XLA's CPU
  layout assignment moved the size-1 axis around and copied the whole cache every step.
  ring_pages: windowed pages, the sliding-window layers' rings of all sequences together
  (max_seqs * window_pages pages) instead of num_pages."""
  def shape(layer):
    pages = ring_pages if ring_pages and not cfg.is_global(layer) else num_pages
    return (pages, page_size, 2 * cfg.num_kv_heads * cfg.head_dim)
  return [jnp.zeros(shape(i), dtype) for i in range(cfg.num_layers)]


def ring_page_table(max_seqs: int, max_pages: int, window_pages: int) -> jax.Array:
  """The sliding-window layers' page table under windowed pages: sequence s's page i is ring
  page s * window_pages + i % window_pages, so its last window_pages pages are in the ring
  (the scheduler caps chunks so that a step never overwrites a key its rows still read)."""
  seq = lax.broadcasted_iota(jnp.int32, (max_seqs, max_pages), 0)
  page = lax.broadcasted_iota(jnp.int32, (max_seqs, max_pages), 1)
  return seq * window_pages + page % window_pages


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype: Any = jnp.bfloat16, *,
                  windowed: bool = False) -> int:
  """Device bytes one page of `init_kv_cache` costs: keys and values of page_size tokens in
  every layer or, with windowed pages, in the global layers (the others hold rings)."""
  layers = sum(cfg.is_global(i) for i in range(cfg.num_layers)) if windowed else cfg.num_layers
  return layers * page_size * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def max_kv_pages(cfg: ModelConfig, page_size: int) -> int:
  """The most pages a layer's kv_pages may have: the Pallas kernels address it with 32-bit
  element offsets (Triton multiplies an index by its stride in the index's type, so an
  array past 2**31 elements would be read and written at wrapped offsets). The 270M's cache
  reaches that on an H200 when the memory alone sizes it."""
  return (2**31 - 1) // (page_size * 2 * cfg.num_kv_heads * cfg.head_dim)


def ring_bytes(cfg: ModelConfig, page_size: int, ring_pages: int,
               dtype: Any = jnp.bfloat16) -> int:
  """Device bytes of the sliding-window layers' rings (`init_kv_cache(ring_pages=...)`)."""
  return (kv_page_bytes(cfg, page_size, dtype)
          - kv_page_bytes(cfg, page_size, dtype, windowed=True)) * ring_pages


def _str_keys(tree: Any) -> Any:
  """NNX state keys (ints for list entries) -> contract keys (strings)."""
  if isinstance(tree, dict):
    return {str(k): _str_keys(v) for k, v in tree.items()}
  return tree


def _int_keys(tree: Any) -> Any:
  """Contract keys -> NNX state keys (decimal strings back to the ints of nnx.List)."""
  if isinstance(tree, dict):
    return {(int(k) if k.isdecimal() else k): _int_keys(v) for k, v in tree.items()}
  return tree


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": x}} -> {"a/b": x}."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flatten(v, f"{prefix}/{k}" if prefix else str(k)))
  return out


@dataclasses.dataclass(frozen=True)
class StepKernels:
  """The functions a serving step (`Gemma.forward`) runs, each the jnp reference by default;
  `blink_jax.kernels.select.step_kernels` picks faster ones. A faster set agrees among itself
  on the layouts it hands over: `pallas_norm.prepare_qkv` can hand the Pallas attention its
  query grouped by KV head and padded, and the CUDA GEMV's output and down projections hand
  split partial sums to the Pallas add + norm kernel, which adds them up."""
  attention: AttentionFn = paged_attention_reference
  prepare: PrepareFn = prepare_qkv      # fused projection -> query, cache with the rows written
  add_norm: AddNormFn = add_rms_norm    # residual add + the next RMSNorm
  qkv_matmul: MatmulFn | None = None    # the q/k/v projection's matmul (None: `@`)
  out_project: OutFn | None = None      # the attention output's projection (None: Attention.out)
  gate_up_matmul: MatmulFn | None = None  # the gate/up projection's matmul (None: `@`)
  ffw_down: FfwDownFn = MLP.down_project  # GELU(gate) x up, then the down projection
  logits: LogitsFn | None = None          # the tied output layer (None: Gemma.logits' einsum)
  # The sampler's top-k / top-p thresholds (`cuda_sampler.thresholds`; None: its searches).
  thresholds: Callable[..., jax.Array] | None = None


REFERENCE_KERNELS = StepKernels()
