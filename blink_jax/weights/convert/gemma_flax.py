"""Gemma Flax checkpoints (orbax, the parameter tree of Google's `gemma` library) -> our tree.

The `gemma` library's names and shapes (gemma/gm/nn/_modules.py, _layers.py):
  embedder/input_embedding            [V, D]
  layer_N/pre_attention_norm/scale    [D]    (also post_attention_norm, pre_ffw_norm,
                                              post_ffw_norm; norms scale by 1 + w like ours)
  layer_N/attn/q_einsum/w             [H, D, h]
  layer_N/attn/kv_einsum/w            [2, K, D, h]   (k, v)
  layer_N/attn/qkv_einsum/w           [3, H, D, h]   (instead of the two above when K == H)
  layer_N/attn/attn_vec_einsum/w      [H, h, D]
  layer_N/attn/_query_norm/scale      [h]    (Gemma 3; also _key_norm)
  layer_N/mlp/gating_einsum           [2, F, D] or, in older checkpoints, [2, D, F] (gate, up)
  layer_N/mlp/linear                  [F, D]
  final_norm/scale                    [D]
Google's released checkpoints store this "flat": keys 'transformer/layer_N/attn/q_einsum' ->
{'w': ...} and the MLP as 'transformer/layer_N/mlp/gating_einsum' -> {'w': ...}; Kauldron
training checkpoints nest it under 'params', and some stack layers of one attention type
('stacked_layers/attention_type_P/...' with a leading layer axis). All of these are read here.
Vision-encoder weights of multimodal checkpoints are ignored.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from blink_jax.model.config import ModelConfig
from blink_jax.weights.convert import Converted, check_tree, flatten, resolve_config

log = logging.getLogger(__name__)

_IGNORED = ("vision_encoder/", "SigLiPFromPatches_0/", "embedder/mm_", "embedder/audio_")
_NORMS = {"pre_attention_norm": "pre_attn_norm", "post_attention_norm": "post_attn_norm",
          "pre_ffw_norm": "pre_ffw_norm", "post_ffw_norm": "post_ffw_norm"}


def convert(path: str | os.PathLike, *, config: ModelConfig | str | None = None,
            progress: bool = True) -> Converted:
  """Converts the orbax checkpoint at `path` (its params directory).

  A `tokenizer.model` next to or inside `path` is picked up; Google ships it separately, so
  usually pass it (convert(..., tokenizer=...)).
  """
  path = Path(path)
  flat = normalize(load_orbax(path))
  layers = sorted({int(m.group(1)) for k in flat if (m := re.match(r"layer_(\d+)/", k))})
  if not layers or layers != list(range(len(layers))) or "embedder/input_embedding" not in flat:
    raise ValueError(f"{path} does not look like a Gemma checkpoint (keys: {sorted(flat)[:8]})")
  cfg = _config(flat, len(layers), config)
  params: dict[str, Any] = {"embed": flat["embedder/input_embedding"],
                            "final_norm": flat["final_norm/scale"], "layers": {}}
  for i in tqdm(layers, desc="converting Gemma Flax layers", unit="layer",
                disable=not progress):
    params["layers"][str(i)] = _layer({k[len(f"layer_{i}/"):]: v for k, v in flat.items()
                                       if k.startswith(f"layer_{i}/")}, cfg)
  check_tree(cfg, params)
  tok = next((p for p in (path / "tokenizer.model", path.parent / "tokenizer.model")
              if p.exists()), None)
  return Converted(cfg, params, tok.read_bytes() if tok else None)


def load_orbax(path: Path) -> dict[str, Any]:
  """The checkpoint's tree as numpy arrays (host memory; no device involved)."""
  import jax  # orbax needs JAX; imported here so the other converters do not
  import orbax.checkpoint as ocp

  if not path.exists():
    raise FileNotFoundError(f"orbax checkpoint not found: {path}")
  ckptr = ocp.PyTreeCheckpointer()
  meta = ckptr.metadata(path)
  tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
  if tree is None and (path / "default").is_dir():  # Kauldron keeps the state in default/
    return load_orbax(path / "default")
  if tree is None:
    raise ValueError(f"no orbax tree metadata in {path}")
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return ckptr.restore(path, restore_args=args)


def normalize(tree: dict[str, Any]) -> dict[str, np.ndarray]:
  """Flat 'layer_N/attn/q_einsum/w'-style keys from any of the layouts described above."""
  flat = flatten(tree)
  if {k.split("/")[0] for k in flat} >= {"params", "opt_state"}:  # Kauldron train state
    flat = {k[len("params/"):]: v for k, v in flat.items() if k.startswith("params/")}
  stacked = [int(m.group(1)) for k in flat
             if (m := re.search(r"stacked_layers/attention_type_(\d+)/", k))]
  period = 1 + max(stacked, default=0)  # the attention pattern's length
  out: dict[str, np.ndarray] = {}
  for key, value in flat.items():
    key = key.removeprefix("transformer/")
    if key.endswith(("mlp/gating_einsum/w", "mlp/linear/w")):
      key = key[:-len("/w")]
    if key.startswith(_IGNORED):
      continue
    m = re.match(r"stacked_layers/attention_type_(\d+)/(.*)", key)
    if m:  # slice s of pattern position p is layer s * period + p
      for s, part in enumerate(np.asarray(value)):
        out[f"layer_{s * period + int(m.group(1))}/{m.group(2)}"] = part
    else:
      out[key] = np.asarray(value)
  return out


def _attn_shapes(attn: dict[str, np.ndarray]) -> tuple[int, int, int]:
  """(num_heads, num_kv_heads, head_dim) of one layer's attention weights."""
  if "qkv_einsum/w" in attn:
    _, H, _, h = attn["qkv_einsum/w"].shape
    return H, H, h
  H, _, h = attn["q_einsum/w"].shape
  return H, attn["kv_einsum/w"].shape[1], h


def _config(flat: dict[str, np.ndarray], num_layers: int,
            config: ModelConfig | str | None) -> ModelConfig:
  if "layer_0/post_attention_norm/scale" not in flat:
    raise ValueError("checkpoint has no post-attention norms: Gemma 1 is not supported")
  V, D = flat["embedder/input_embedding"].shape
  H, K, h = _attn_shapes({k[len("layer_0/attn/"):]: v for k, v in flat.items()
                          if k.startswith("layer_0/attn/")})
  F = flat["layer_0/mlp/linear"].shape[0]
  family = "gemma3" if "layer_0/attn/_query_norm/scale" in flat else "gemma2"
  shapes = dict(vocab_size=V, d_model=D, num_layers=num_layers, num_heads=H, num_kv_heads=K,
                head_dim=h, ffw_hidden=F)
  return resolve_config(family, shapes, config=config)


def _layer(w: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
  def heads_last(x):  # [heads, D, h] -> [D, heads, h]
    return np.ascontiguousarray(np.transpose(x, (1, 0, 2)))

  if "attn/qkv_einsum/w" in w:
    q, k, v = w["attn/qkv_einsum/w"]
  else:
    q = w["attn/q_einsum/w"]
    k, v = w["attn/kv_einsum/w"]
  attn = {"q": heads_last(q), "k": heads_last(k), "v": heads_last(v),
          "o": w["attn/attn_vec_einsum/w"]}
  if cfg.use_qk_norm:
    attn |= {"q_norm": w["attn/_query_norm/scale"], "k_norm": w["attn/_key_norm/scale"]}
  gating = w["mlp/gating_einsum"]
  if gating.shape[1:] == (cfg.ffw_hidden, cfg.d_model):  # [2, F, D]
    gate, up = (np.ascontiguousarray(g.T) for g in gating)
  else:  # the older [2, D, F]
    gate, up = gating
  out = {ours: w[f"{theirs}/scale"] for theirs, ours in _NORMS.items()}
  return {**out, "attn": attn,
          "mlp": {"gate": gate, "up": up, "down": w["mlp/linear"]}}
