"""Converters from the formats Gemma is published in to our parameter tree.

Every converter returns a `Converted`: the `ModelConfig`, a nested dict of numpy arrays in the
layout of docs/ARCHITECTURE.md, "Parameter tree" (norm weights the Gemma way: effective
scale 1 + w) and the SentencePiece model bytes when the source carries a tokenizer.

  gguf        llama.cpp GGUF files (dequantized), tokenizer rebuilt from the GGUF metadata
  hf          Hugging Face safetensors directories (Gemma3ForCausalLM, Gemma2ForCausalLM)
  gemma_flax  orbax checkpoints in the layout of Google's `gemma` library
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from blink_jax.model.config import CONFIGS, ModelConfig, get_config

log = logging.getLogger(__name__)

SOURCES = ("gguf", "hf", "gemma_flax")

# The fields of ModelConfig that the weights' shapes determine.
SHAPE_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "ffw_hidden")


@dataclasses.dataclass
class Converted:
  config: ModelConfig
  params: dict[str, Any]
  tokenizer_model: bytes | None


def convert(source: str, path: str | os.PathLike, *, config: ModelConfig | str | None = None,
            tokenizer: str | os.PathLike | None = None, progress: bool = True) -> Converted:
  """Converts the checkpoint at `path`, a `source` format (one of SOURCES).

  `config` (a ModelConfig or a name in blink_jax.model.config.CONFIGS) supplies what the source does
  not state; `tokenizer` (a tokenizer.model file) replaces or supplies the tokenizer.
  """
  if source == "gguf":
    from blink_jax.weights.convert import gguf as module
  elif source == "hf":
    from blink_jax.weights.convert import hf as module
  elif source == "gemma_flax":
    from blink_jax.weights.convert import gemma_flax as module
  else:
    raise ValueError(f"unknown checkpoint source {source!r}; known: {list(SOURCES)}")
  if not Path(path).exists():
    raise FileNotFoundError(f"{source} checkpoint not found: {path}")
  out = module.convert(path, config=config, progress=progress)
  if tokenizer is not None:
    out.tokenizer_model = Path(tokenizer).read_bytes()
  return out


def resolve_config(family: str, shapes: dict[str, int], *,
                   config: ModelConfig | str | None = None,
                   stated: dict[str, Any] | None = None) -> ModelConfig:
  """The ModelConfig of a checkpoint whose weights have `shapes` (SHAPE_FIELDS).

  Precedence, per field: what the source itself states (`stated`, e.g. HF config.json or GGUF
  metadata) > the given `config` > the row of CONFIGS with the same family and shapes > the
  family's defaults (logged, since such guesses may be wrong). Shapes must agree with `config`.
  """
  if isinstance(config, str):
    config = get_config(config)
  if config is not None:
    if config.family != family:
      raise ValueError(f"config {config.name!r} is {config.family}, checkpoint is {family}")
    wrong = {f: (getattr(config, f), shapes[f]) for f in SHAPE_FIELDS
             if f != "vocab_size" and getattr(config, f) != shapes[f]}
    if wrong:
      raise ValueError(f"config {config.name!r} does not match the checkpoint's shapes "
                       f"(field: config vs checkpoint): {wrong}")
    base = config
  else:
    base = _named_match(family, shapes)
    if base is None:
      base = _family_default(family, shapes)
      log.warning("no known %s config has these shapes %s; assuming %s defaults for window, "
                  "attention pattern and RoPE (pass a config to be explicit)",
                  family, shapes, family)
  if base.vocab_size != shapes["vocab_size"]:
    # e.g. Gemma 2 Flax checkpoints pad the 256,000-token vocabulary to 256,128 rows.
    log.info("vocab size %d (config %s says %d)", shapes["vocab_size"], base.name,
             base.vocab_size)
  return base.replace(**{**shapes, **(stated or {})})


def _named_match(family: str, shapes: dict[str, int]) -> ModelConfig | None:
  for cfg in CONFIGS.values():
    if cfg.family == family and all(getattr(cfg, f) == shapes[f] for f in SHAPE_FIELDS
                                    if f != "vocab_size"):
      return cfg
  return None


def _family_default(family: str, shapes: dict[str, int]) -> ModelConfig:
  defaults = {"gemma3": "gemma3-1b", "gemma2": "gemma2-2b"}
  if family not in defaults:
    raise ValueError(f"unsupported model family {family!r}; known: {sorted(defaults)}")
  return get_config(defaults[family]).replace(
      query_pre_attn_scalar=float(shapes["head_dim"]), name="custom")


def check_tree(cfg: ModelConfig, params: dict[str, Any]) -> None:
  """Raises if `params` does not have exactly the contract's keys and shapes for `cfg`."""
  expected = expected_shapes(cfg)
  got = {k: tuple(v.shape) for k, v in flatten(params).items()}
  missing = sorted(set(expected) - set(got))
  extra = sorted(set(got) - set(expected))
  wrong = {k: (got[k], expected[k]) for k in expected if k in got and got[k] != expected[k]}
  if missing or extra or wrong:
    raise ValueError(f"converted tree does not match the contract: missing={missing[:8]} "
                     f"extra={extra[:8]} wrong shapes (got, want)={dict(list(wrong.items())[:8])}")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Flat '/'-joined key -> shape of the parameter tree (docs/ARCHITECTURE.md, "Parameter tree")."""
  D, H, K, h, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffw_hidden
  out = {"embed": (cfg.vocab_size, D), "final_norm": (D,)}
  for i in range(cfg.num_layers):
    p = f"layers/{i}/"
    for n in ("pre_attn_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm"):
      out[p + n] = (D,)
    out |= {p + "attn/q": (D, H, h), p + "attn/k": (D, K, h), p + "attn/v": (D, K, h),
            p + "attn/o": (H, h, D), p + "mlp/gate": (D, F), p + "mlp/up": (D, F),
            p + "mlp/down": (F, D)}
    if cfg.use_qk_norm:
      out |= {p + "attn/q_norm": (h,), p + "attn/k_norm": (h,)}
  return out


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out |= flatten(v, f"{prefix}{k}/")
    else:
      out[prefix + k] = v
  return out


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, v in flat.items():
    *path, leaf = key.split("/")
    node = out
    for p in path:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out


def layer_from_linear(w: dict[str, np.ndarray], *, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> dict[str, Any]:
  """One layer of our tree from weights stored the nn.Linear way ([out, in]: HF, GGUF).

  `w` holds q, k, v, o, gate, up, down as [out, in] matrices, the four block norms and, for
  Gemma 3, q_norm and k_norm (all norms already the Gemma way, scale 1 + w).
  """
  def t(x):  # [out, in] -> [in, out]
    return np.ascontiguousarray(np.asarray(x).T)
  H, K, h = num_heads, num_kv_heads, head_dim
  D = w["q"].shape[1]
  attn = {"q": t(w["q"]).reshape(D, H, h), "k": t(w["k"]).reshape(D, K, h),
          "v": t(w["v"]).reshape(D, K, h), "o": t(w["o"]).reshape(H, h, D)}
  if "q_norm" in w:
    attn |= {"q_norm": np.asarray(w["q_norm"]), "k_norm": np.asarray(w["k_norm"])}
  out = {n: np.asarray(w[n]) for n in ("pre_attn_norm", "post_attn_norm", "pre_ffw_norm",
                                        "post_ffw_norm")}
  return {**out, "attn": attn, "mlp": {"gate": t(w["gate"]), "up": t(w["up"]),
                                       "down": t(w["down"])}}
