"""blink-jax: a JAX-native LLM inference server for Gemma models.

`from blink_jax import Engine, SamplingParams` loads JAX lazily, so JAX-free layers
(blink_jax.client, blink_jax.engine_config, blink_jax.env) import without it.
"""
from typing import Any

__all__ = ["Engine", "EngineConfig", "KernelOptions", "SamplingParams", "RequestOutput",
           "StreamDelta", "EngineStoppedError"]


def __getattr__(name: str) -> Any:
  if name in __all__:
    from blink_jax import engine
    return getattr(engine, name)
  raise AttributeError(f"module 'blink_jax' has no attribute {name!r}")
