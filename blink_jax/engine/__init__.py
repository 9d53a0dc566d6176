"""The engine: the Python API (`engine`) over one executor and one mailbox."""
from blink_jax.engine.engine import (Engine, EngineStoppedError, RequestOutput, SamplingParams,
                                     StreamDelta)
from blink_jax.engine_config import EngineConfig, KernelOptions

__all__ = ["Engine", "EngineConfig", "EngineStoppedError", "KernelOptions", "RequestOutput",
           "SamplingParams", "StreamDelta"]
