"""GGUF (llama.cpp) -> our tree: dequantized weights, config and tokenizer from the metadata.

Two things llama.cpp's converter (convert_hf_to_gguf.py) does to Gemma that are undone here,
the same way transformers' GGUF loader undoes them (Gemma2TensorProcessor: `weights - 1`):
  * every RMSNorm weight (block norms, q/k norms, output_norm) is stored as 1 + w;
  * the tokenizer's user-defined pieces have U+2581 spelled as a real space, and <unk> is
    marked CONTROL.
Gemma uses half-split ("NEOX") RoPE, so unlike llama the q/k rows are not permuted.
"""
from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from blink_jax.client import tokenizer as tok
from blink_jax.weights.convert import Converted, check_tree, layer_from_linear, resolve_config
from blink_jax.model.config import ModelConfig

FAMILIES = ("gemma3", "gemma2")

# GGUF block tensor name -> our name (norms) or the nn.Linear role (matrices).
_BLOCK = {
    "attn_norm": "pre_attn_norm", "post_attention_norm": "post_attn_norm",
    "ffn_norm": "pre_ffw_norm", "post_ffw_norm": "post_ffw_norm",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
}


def convert(path: str | os.PathLike, *, config: ModelConfig | str | None = None,
            progress: bool = True) -> Converted:
  reader = gguf.GGUFReader(os.fspath(path))
  cfg = read_config(reader, config=config)
  tensors = {t.name: t for t in reader.tensors}
  bar = tqdm(total=len(tensors), desc="dequantizing GGUF", unit="tensor", disable=not progress)

  def get(name: str) -> np.ndarray:
    if name not in tensors:
      raise KeyError(f"GGUF tensor {name!r} missing from {path}")
    bar.update()
    x = dequantize(tensors[name])
    return x - np.float32(1) if name.endswith("norm.weight") else x

  params: dict[str, Any] = {"embed": get("token_embd.weight"),
                            "final_norm": get("output_norm.weight"), "layers": {}}
  for i in range(cfg.num_layers):
    names = [n for n in _BLOCK if cfg.use_qk_norm or n not in ("attn_q_norm", "attn_k_norm")]
    w = {_BLOCK[n]: get(f"blk.{i}.{n}.weight") for n in names}
    params["layers"][str(i)] = layer_from_linear(
        w, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
  bar.close()
  if "output.weight" in tensors:
    # Gemma ties the LM head to the embedding; an untied head cannot be represented.
    if not np.array_equal(dequantize(tensors["output.weight"]), params["embed"]):
      raise ValueError("GGUF has an untied output.weight; Gemma's LM head is the embedding")
  check_tree(cfg, params)
  return Converted(cfg, params, tokenizer_model(reader))


def dequantize(t: Any) -> np.ndarray:
  """float32 array of a GGUF tensor in numpy order (GGUF lists dims fastest-first)."""
  x = gguf.quants.dequantize(t.data, t.tensor_type)
  return np.asarray(x, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])


def field(reader: Any, key: str, default: Any = None) -> Any:
  f = reader.fields.get(key)
  return default if f is None else f.contents()


def read_config(reader: Any, *, config: ModelConfig | str | None = None) -> ModelConfig:
  arch = field(reader, "general.architecture")
  if arch not in FAMILIES:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; known: {list(FAMILIES)}")

  def meta(key: str, default: Any = None) -> Any:
    return field(reader, f"{arch}.{key}", default)

  embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
  d_model, vocab = (int(d) for d in embed.shape)
  heads = int(meta("attention.head_count"))
  shapes = dict(vocab_size=vocab, d_model=d_model, num_layers=int(meta("block_count")),
                num_heads=heads, num_kv_heads=int(meta("attention.head_count_kv", heads)),
                head_dim=int(meta("attention.key_length", d_model // heads)),
                ffw_hidden=int(meta("feed_forward_length")))
  stated: dict[str, Any] = {}
  for key, name, kind in [("attention.sliding_window", "sliding_window", int),
                          ("attention.layer_norm_rms_epsilon", "rms_norm_eps", float),
                          ("context_length", "max_context", int),
                          ("attn_logit_softcapping", "attn_logit_softcap", float),
                          ("final_logit_softcapping", "final_logit_softcap", float)]:
    if meta(key) is not None:
      stated[name] = kind(meta(key))
  base = meta("rope.freq_base")
  if arch == "gemma2":
    if base is not None:  # Gemma 2 uses one RoPE base for all layers
      stated |= {"rope_base_local": float(base), "rope_base_global": float(base)}
  else:
    if base is not None:  # gemma3.rope.freq_base is the global layers' base
      stated["rope_base_global"] = float(base)
    if meta("rope.freq_base_swa") is not None:
      stated["rope_base_local"] = float(meta("rope.freq_base_swa"))
    if meta("rope.scaling.type") == "linear":
      stated["rope_scale_global"] = float(meta("rope.scaling.factor"))
  pattern = meta("attention.sliding_window_pattern")
  if pattern is not None:
    stated["global_every"] = _global_every(pattern, shapes["num_layers"])
  return resolve_config(arch, shapes, config=config, stated=stated)


def _global_every(pattern: Any, num_layers: int) -> int:
  """ModelConfig.global_every from llama.cpp's sliding_window_pattern (period, or per-layer
  list where True means sliding)."""
  if isinstance(pattern, int):
    return pattern
  sliding = [bool(x) for x in pattern]
  period = next((i + 1 for i, s in enumerate(sliding) if not s), None)
  if period is None or any(s != ((i + 1) % period != 0) for i, s in enumerate(sliding)):
    raise ValueError(f"unsupported sliding window pattern {sliding} for {num_layers} layers")
  return period


def tokenizer_model(reader: Any) -> bytes:
  """The SentencePiece model that llama.cpp took the GGUF vocabulary from, rebuilt."""
  kind = field(reader, "tokenizer.ggml.model")
  if kind != "llama":
    raise ValueError(f"GGUF tokenizer {kind!r} is not a SentencePiece model")
  tokens = field(reader, "tokenizer.ggml.tokens")
  scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
  types = field(reader, "tokenizer.ggml.token_type") or [tok.NORMAL] * len(tokens)
  unk = field(reader, "tokenizer.ggml.unknown_token_id")
  pieces = []
  for i, (piece, score, kind) in enumerate(zip(tokens, scores, types)):
    if kind == tok.USER_DEFINED:
      piece = piece.replace(" ", "\u2581")  # llama.cpp wrote user-defined U+2581 as spaces
    if i == unk:
      kind = tok.UNKNOWN  # SentencePiece needs exactly one UNKNOWN piece
    pieces.append((piece, float(score), int(kind)))
  if field(reader, "tokenizer.ggml.add_space_prefix", False):
    raise ValueError("GGUF tokenizer adds a space prefix; Gemma's does not (unsupported)")
  return tok.build_sentencepiece_model(
      pieces, unk_id=unk, bos_id=field(reader, "tokenizer.ggml.bos_token_id"),
      eos_id=field(reader, "tokenizer.ggml.eos_token_id"),
      pad_id=field(reader, "tokenizer.ggml.padding_token_id", -1), model_type="bpe")
