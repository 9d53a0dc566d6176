"""Model configurations: the one table of Gemma shapes.

Every size of Gemma 2 and Gemma 3 text models is a row of `CONFIGS`; checkpoints store the
config they were converted with as `config.json` (see `ModelConfig.to_json`).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str  # "gemma3" | "gemma2"
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffw_hidden: int
  sliding_window: int
  # Layer i is global (full attention) when (i + 1) % global_every == 0, local otherwise.
  global_every: int
  query_pre_attn_scalar: float  # queries are scaled by query_pre_attn_scalar ** -0.5
  rope_base_local: float = 10_000.0
  rope_base_global: float = 1_000_000.0
  rope_scale_global: float = 1.0  # linear position scaling of global layers (Gemma 3 4B+: 8)
  attn_logit_softcap: float | None = None  # Gemma 2: 50
  final_logit_softcap: float | None = None  # Gemma 2: 30
  use_qk_norm: bool = True  # Gemma 3
  rms_norm_eps: float = 1e-6
  max_context: int = 32_768
  name: str = "custom"

  def is_global(self, layer: int) -> bool:
    return (layer + 1) % self.global_every == 0

  def window(self, layer: int) -> int | None:
    """Sliding-window size of `layer`, None for a global layer."""
    return None if self.is_global(layer) else self.sliding_window

  def rope(self, layer: int) -> tuple[float, float]:
    """(base, position scale) of `layer`'s rotary embedding."""
    if self.is_global(layer):
      return self.rope_base_global, self.rope_scale_global
    return self.rope_base_local, 1.0

  def replace(self, **kw: Any) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
    return cls(**d)

  @classmethod
  def from_json(cls, text: str) -> "ModelConfig":
    return cls.from_dict(json.loads(text))


def _gemma3(name, d, layers, heads, kv, ffw, window, head_dim=256, qpas=256.0, scale=1.0,
            ctx=32_768):
  return ModelConfig(family="gemma3", vocab_size=262_144, d_model=d, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, head_dim=head_dim, ffw_hidden=ffw,
                     sliding_window=window, global_every=6, query_pre_attn_scalar=qpas,
                     rope_scale_global=scale, max_context=ctx, name=name)


def _gemma2(name, d, layers, heads, kv, ffw, head_dim=256, qpas=256.0):
  return ModelConfig(family="gemma2", vocab_size=256_000, d_model=d, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, head_dim=head_dim, ffw_hidden=ffw,
                     sliding_window=4096, global_every=2, query_pre_attn_scalar=qpas,
                     rope_base_global=10_000.0, attn_logit_softcap=50.0,
                     final_logit_softcap=30.0, use_qk_norm=False, max_context=8192, name=name)


CONFIGS: dict[str, ModelConfig] = {
    c.name: c for c in [
        _gemma3("gemma3-270m", 640, 18, 4, 1, 2048, 512),
        _gemma3("gemma3-1b", 1152, 26, 4, 1, 6912, 512),
        _gemma3("gemma3-4b", 2560, 34, 8, 4, 10240, 1024, scale=8.0, ctx=131_072),
        _gemma3("gemma3-12b", 3840, 48, 16, 8, 15360, 1024, scale=8.0, ctx=131_072),
        _gemma3("gemma3-27b", 5376, 62, 32, 16, 21504, 1024, head_dim=128, qpas=168.0,
                scale=8.0, ctx=131_072),
        _gemma2("gemma2-2b", 2304, 26, 8, 4, 9216),
        _gemma2("gemma2-9b", 3584, 42, 16, 8, 14336),
        _gemma2("gemma2-27b", 4608, 46, 32, 16, 36864, head_dim=128, qpas=144.0),
    ]
}


def get_config(name: str) -> ModelConfig:
  try:
    return CONFIGS[name]
  except KeyError:
    raise ValueError(f"unknown model config {name!r}; known: {sorted(CONFIGS)}") from None


def tiny_config(family: str = "gemma3", **kw: Any) -> ModelConfig:
  """A small random-test shape of the given family (fast on CPU)."""
  base = CONFIGS["gemma3-270m" if family == "gemma3" else "gemma2-2b"]
  small = dict(vocab_size=512, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2,
               head_dim=16, ffw_hidden=128, sliding_window=8, query_pre_attn_scalar=16.0,
               max_context=256, name=f"tiny-{family}")
  if family == "gemma3":
    small["global_every"] = 3
  small.update(kw)
  return base.replace(**small)
