"""Hugging Face safetensors directory (Gemma3ForCausalLM / Gemma2ForCausalLM) -> our tree.

HF stores Gemma's norms the Gemma way already (Gemma{2,3}RMSNorm scales by 1 + w) and uses the
same half-split RoPE as Gemma, so only the layout changes: nn.Linear [out, in] matrices become
our [in, heads, head_dim] / [in, out] arrays. Multimodal Gemma 3 checkpoints
(Gemma3ForConditionalGeneration) convert too: their text model is used, the vision tower ignored.
"""
from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from tqdm import tqdm

from blink_jax.model.config import ModelConfig
from blink_jax.weights.convert import Converted, check_tree, layer_from_linear, resolve_config

log = logging.getLogger(__name__)

_FAMILIES = {"gemma3_text": "gemma3", "gemma3": "gemma3", "gemma2": "gemma2"}

# HF module path inside a decoder layer -> our name (norms) or nn.Linear role (matrices).
_LAYER = {
    "input_layernorm": "pre_attn_norm", "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "pre_ffw_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm",
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down",
}


def convert(path: str | os.PathLike, *, config: ModelConfig | str | None = None,
            progress: bool = True) -> Converted:
  path = Path(path)
  cfg = read_config(path, config=config)
  weights = read_safetensors_dir(path)
  prefix = _decoder_prefix(weights)

  def get(name: str) -> np.ndarray:
    if prefix + name not in weights:
      raise KeyError(f"weight {prefix + name!r} missing from {path}")
    return weights[prefix + name]

  names = [n for n in _LAYER if cfg.use_qk_norm or not n.endswith(("q_norm", "k_norm"))]
  params: dict[str, Any] = {"embed": np.asarray(get("embed_tokens.weight")),
                            "final_norm": np.asarray(get("norm.weight")), "layers": {}}
  for i in tqdm(range(cfg.num_layers), desc="converting HF layers", unit="layer",
                disable=not progress):
    w = {role: get(f"layers.{i}.{n}.weight") for n, role in _LAYER.items() if n in names}
    params["layers"][str(i)] = layer_from_linear(
        w, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
  head = next((k for k in weights if k.endswith("lm_head.weight")), None)
  if head is not None and not np.array_equal(weights[head], params["embed"]):
    raise ValueError("checkpoint has an untied lm_head; Gemma's LM head is the embedding")
  check_tree(cfg, params)
  spm = path / "tokenizer.model"
  if not spm.exists():
    log.warning("%s has no tokenizer.model; pass a tokenizer explicitly", path)
  return Converted(cfg, params, spm.read_bytes() if spm.exists() else None)


def read_config(path: Path, *, config: ModelConfig | str | None = None) -> ModelConfig:
  file = path / "config.json"
  if not file.exists():
    raise FileNotFoundError(f"HF checkpoint has no config.json: {file}")
  hf = json.loads(file.read_text())
  if hf.get("model_type") == "gemma3" and "text_config" in hf:
    hf = {"model_type": "gemma3_text", **hf["text_config"]}
  family = _FAMILIES.get(hf.get("model_type"))
  if family is None:
    raise ValueError(f"unsupported HF model_type {hf.get('model_type')!r}; "
                     f"known: {sorted(_FAMILIES)}")
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
  if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(f"unsupported activation {act!r}; Gemma uses tanh-approximated GELU")
  heads = hf["num_attention_heads"]
  shapes = dict(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads", heads),
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                ffw_hidden=hf["intermediate_size"])
  stated: dict[str, Any] = {}
  for key, name in [("sliding_window", "sliding_window"),
                    ("query_pre_attn_scalar", "query_pre_attn_scalar"),
                    ("rms_norm_eps", "rms_norm_eps"),
                    ("max_position_embeddings", "max_context"),
                    ("attn_logit_softcapping", "attn_logit_softcap"),
                    ("final_logit_softcapping", "final_logit_softcap")]:
    if key in hf:
      stated[name] = hf[key]
  if stated.get("query_pre_attn_scalar") is not None:
    stated["query_pre_attn_scalar"] = float(stated["query_pre_attn_scalar"])
  stated |= _rope(hf, family)
  every = _global_every(hf, shapes["num_layers"])
  if every is not None:
    stated["global_every"] = every
  return resolve_config(family, shapes, config=config, stated=stated)


def _rope(hf: dict[str, Any], family: str) -> dict[str, Any]:
  """RoPE bases and the global layers' linear scaling, from either config.json vintage:
  transformers 5 `rope_parameters` (per layer type for Gemma 3) or 4.x `rope_theta`,
  `rope_local_base_freq` and `rope_scaling`."""
  out: dict[str, Any] = {}
  params = hf.get("rope_parameters")
  if isinstance(params, dict) and "full_attention" in params:
    full, local = params["full_attention"], params.get("sliding_attention", {})
  else:
    full = dict(params or {})
    if "rope_theta" in hf:
      full.setdefault("rope_theta", hf["rope_theta"])
    if hf.get("rope_scaling"):
      full |= hf["rope_scaling"]
    local = {"rope_theta": hf["rope_local_base_freq"]} if "rope_local_base_freq" in hf else {}
    if family == "gemma2" and "rope_theta" in full:
      local = {"rope_theta": full["rope_theta"]}  # Gemma 2: one base for every layer
  if "rope_theta" in full:
    out["rope_base_global"] = float(full["rope_theta"])
  if "rope_theta" in local:
    out["rope_base_local"] = float(local["rope_theta"])
  kind = full.get("rope_type", full.get("type", "default"))
  if kind == "linear":
    out["rope_scale_global"] = float(full["factor"])
  elif kind != "default":
    raise ValueError(f"unsupported RoPE scaling {kind!r} (Gemma uses linear)")
  return out


def _global_every(hf: dict[str, Any], num_layers: int) -> int | None:
  types = hf.get("layer_types")
  if types:
    every = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), None)
    if every is None or any((t == "full_attention") != ((i + 1) % every == 0)
                            for i, t in enumerate(types)):
      raise ValueError(f"unsupported layer_types pattern {types}")
    return every
  for key in ("sliding_window_pattern", "_sliding_window_pattern"):
    if hf.get(key):
      return int(hf[key])
  return None


def _decoder_prefix(weights: dict[str, np.ndarray]) -> str:
  """'model.' for a causal LM, 'model.language_model.' etc. for a multimodal Gemma 3."""
  anchor = "layers.0.self_attn.q_proj.weight"
  # A vision tower has layers too; the decoder is the one with the token embedding.
  found = [p for k in weights if k.endswith(anchor)
           if (p := k[:-len(anchor)]) + "embed_tokens.weight" in weights]
  if len(found) != 1:
    raise ValueError(f"expected one decoder (prefix of {anchor!r} with embed_tokens.weight) "
                     f"among the checkpoint's weights, found {found}")
  return found[0]


# safetensors' numpy backend cannot hand out bfloat16 tensors (numpy has no bfloat16), so the
# (documented, trivial) file layout is read directly: 8-byte header length, JSON header, data.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
  """Name -> array, memory-mapped (read-only, nothing loaded until used)."""
  with open(file, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
  data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + size)
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    out[name] = data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


def read_safetensors_dir(path: Path) -> dict[str, np.ndarray]:
  """All tensors of a (possibly sharded) safetensors checkpoint directory."""
  index = path / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
  else:
    files = sorted(p.name for p in path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  out: dict[str, np.ndarray] = {}
  for name in files:
    if not (path / name).exists():
      raise FileNotFoundError(f"shard listed in {index.name} is missing: {path / name}")
    out |= read_safetensors(path / name)
  return out
