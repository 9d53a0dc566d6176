"""Tensor parallelism of the model over one mesh axis (docs/ARCHITECTURE.md, "Tensor
parallelism (design)"): how the weights and the KV cache split over N devices, and the ragged
paged step under `jax.shard_map`, where each device runs `Gemma.forward` of its shard (a
`Gemma` of the local config: H/N query heads, the KV heads they read, F/N hidden units, V/N
vocabulary rows) and the model adds the collectives (`Gemma.tp_axis`).

The serving loop over the mesh (one leader scheduling, its batch broadcast) is the
executor's (`executor/loop.py`, `Executor(tensor_parallel=N)`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from blink_jax.model.config import ModelConfig
from flax import nnx

from blink_jax.model.gemma import Gemma, KVCache, _int_keys, init_kv_cache

TP_AXIS = "tp"

# Where each weight splits: its axis over the heads, the hidden units or the vocabulary
# (None: replicated). Column-parallel q/k/v and gate/up, row-parallel o and down.
_SPLIT_AXIS = {"q": 1, "k": 1, "v": 1, "o": 0, "gate": 1, "up": 1, "down": 0, "embed": 0}


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """cfg split over n devices of the mesh axis TP_AXIS."""
  cfg: ModelConfig
  n: int

  def __post_init__(self):
    c, n = self.cfg, self.n
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"tensor_parallel must be a positive integer, got {n!r}")
    bad = [f"{name} {value}" for name, value in (
        ("num_heads", c.num_heads), ("ffw_hidden", c.ffw_hidden), ("vocab_size", c.vocab_size))
        if value % n]
    if c.num_kv_heads % n and n % c.num_kv_heads:
      bad.append(f"num_kv_heads {c.num_kv_heads} (neither divides the other)")
    if bad:
      raise ValueError(f"{c.name} does not split over tensor_parallel={n}: "
                       + ", ".join(bad) + f" not divisible by {n}")

  @property
  def kv_heads(self) -> int:
    """KV heads of the split model: the model's, or n when it has fewer (each device then
    keeps the one KV head its query heads read: a replicated projection)."""
    return max(self.cfg.num_kv_heads, self.n)

  def local_config(self) -> ModelConfig:
    """One device's shard as a model config."""
    c, n = self.cfg, self.n
    return c.replace(num_heads=c.num_heads // n, num_kv_heads=self.kv_heads // n,
                     ffw_hidden=c.ffw_hidden // n, vocab_size=c.vocab_size // n)

  def split_params(self, params: dict[str, Any]) -> dict[str, Any]:
    """The model's parameter tree with k and v repeated to `kv_heads` heads (query head i
    reads KV head i // (H / K), so device d's heads read head d * K // n)."""
    rep = self.kv_heads // self.cfg.num_kv_heads
    if rep == 1:
      return params
    layers = {}
    for name, layer in params["layers"].items():
      attn = dict(layer["attn"])
      for w in ("k", "v"):
        attn[w] = jnp.repeat(attn[w], rep, axis=1)
      layers[name] = {**layer, "attn": attn}
    return {**params, "layers": layers}

  def param_specs(self, params: dict[str, Any]) -> dict[str, Any]:
    """The PartitionSpec of every entry of a (split) parameter tree."""
    def spec(path, leaf):
      axis = _SPLIT_AXIS.get(getattr(path[-1], "key", None))
      if axis is None:
        return P()
      return P(*[TP_AXIS if i == axis else None for i in range(leaf.ndim)])
    return jax.tree_util.tree_map_with_path(spec, params)

  def kv_spec(self) -> P:
    """Each layer's kv_pages [P, page_size, n * 2 * K_local * h]: device d's own heads' keys,
    then values (the single-device row layout, per device)."""
    return P(None, None, TP_AXIS)

  def init_kv_cache(self, mesh: Mesh, num_pages: int, page_size: int, dtype: Any = jnp.bfloat16,
                    *, ring_pages: int = 0) -> KVCache:
    """Zeroed caches of the split model, each device holding its shard."""
    local = init_kv_cache(self.local_config(), num_pages, page_size, dtype,
                          ring_pages=ring_pages)
    sharding = NamedSharding(mesh, self.kv_spec())
    return [jax.device_put(jnp.zeros((*c.shape[:2], self.n * c.shape[2]), c.dtype), sharding)
            for c in local]

  def place(self, mesh: Mesh, params: dict[str, Any]) -> dict[str, Any]:
    """The split parameter tree on the mesh, each device holding its shard."""
    split = self.split_params(params)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), split,
                        self.param_specs(split))

  def split_model(self, model: Gemma, mesh: Mesh) -> tuple[Any, Any]:
    """(graphdef, state) of the model as traced code under shard_map sees it: the graph of a
    `Gemma` of `local_config` with `tp_axis` set, its state the placed weights (`place`), so
    `nnx.merge` inside the shard_map gives each device's shard as a model."""
    local = nnx.eval_shape(lambda: Gemma(self.local_config(), dtype=model.dtype,
                                         rngs=nnx.Rngs(0)))
    local.tp_axis = TP_AXIS
    graphdef, state = nnx.split(local)
    nnx.replace_by_pure_dict(state, _int_keys(self.place(mesh, model.to_params())))
    return graphdef, state

  def forward(self, mesh: Mesh, *, dtype: Any, **forward_kw: Any) -> Callable[..., Any]:
    """fn(params, tokens, positions, seq_ids, page_table, kv) -> (hidden [T, D], kv): the
    ragged paged step (`Gemma.forward`, `forward_kw` passed on) of the placed parameters,
    every device computing its shard; tokens, positions, seq_ids and page_table replicated,
    the hidden states too (after the last all-reduce). `logits_fn(params, hidden)` is the
    matching output layer."""
    local_cfg = self.local_config()

    def local_model(params) -> Gemma:
      model = Gemma.from_params(local_cfg, params, dtype=dtype)
      model.tp_axis = TP_AXIS
      return model

    def step(params, tokens, positions, seq_ids, page_table, kv):
      return local_model(params).forward(tokens, positions, seq_ids, page_table, kv,
                                         **forward_kw)

    def wrapped(params, tokens, positions, seq_ids, page_table, kv):
      specs = self.param_specs(params)
      kv_specs = [self.kv_spec()] * len(kv)
      return jax.shard_map(step, mesh=mesh,
                           in_specs=(specs, P(), P(), P(), P(), kv_specs),
                           out_specs=(P(), kv_specs), check_vma=False)(
          params, tokens, positions, seq_ids, page_table, kv)

    def logits(params, hidden):
      return jax.shard_map(lambda p, h: local_model(p).logits(h), mesh=mesh,
                           in_specs=(self.param_specs(params), P()), out_specs=P(),
                           check_vma=False)(params, hidden)
    wrapped.logits = logits
    return wrapped
