"""Every environment variable blink-jax reads or sets, declared once (JAX-free).

Behaviour is configured as data (`blink_jax.engine_config`); what stays here are the few
overrides that must come from the environment, each read when it is used (never at import),
and the XLA variables the executor must set before JAX starts. A test checks that no other
module of blink_jax or nic_frontend touches `os.environ`.

| variable | what it does |
| --- | --- |
| BLINK_CHECKPOINT_DIR | where catalog checkpoints are converted to and loaded from (default: `checkpoints/` of the repository) |
| BLINK_NO_COMMAND_BUFFERS=1 | leave XLA's command buffers off (the loop is then host-driven; for diagnosis) |
| BLINK_COMMAND_BUFFER_TYPES | the command types of the persistent loop's CUDA graph (default `xla_flags.COMMAND_TYPES`) |
| BLINK_HOST_COMMAND_BUFFER_TYPES | the same for host mode's step |
| BLINK_HOST_MIN_GRAPH_SIZE | host mode's smallest run of commands put into a CUDA graph |
| BLINK_API_KEY | the API key of the HTTP frontend when neither `--api_key_file` nor `--api_key` is given; `serve.py` hands it to its frontend workers this way (never on a command line, which `ps` shows) |
| BLINK_RELAY_TOKEN | the tcp relay's shared secret, handed by `serve.py` to its frontend workers |
| PROMETHEUS_MULTIPROC_DIR | prometheus-client's folder for metrics of several frontend workers |
| XLA_FLAGS, TF_CPP_VMODULE, TF_CPP_MIN_LOG_LEVEL | XLA's own: set by `xla_flags.configure_command_buffers` before JAX starts |
| XLA_PYTHON_CLIENT_MEM_FRACTION | JAX's: the share of each GPU its allocator's pool takes (JAX's default 0.75). Set by `xla_flags.configure_memory_pool` before JAX starts to the engine's `kv_cache_memory_fraction` (0.9) when not set already; set it yourself and the engine sizes its cache within your pool |
"""
from __future__ import annotations

import os
from pathlib import Path

CHECKPOINT_DIR = "BLINK_CHECKPOINT_DIR"
NO_COMMAND_BUFFERS = "BLINK_NO_COMMAND_BUFFERS"
COMMAND_BUFFER_TYPES = "BLINK_COMMAND_BUFFER_TYPES"
HOST_COMMAND_BUFFER_TYPES = "BLINK_HOST_COMMAND_BUFFER_TYPES"
HOST_MIN_GRAPH_SIZE = "BLINK_HOST_MIN_GRAPH_SIZE"
API_KEY = "BLINK_API_KEY"
RELAY_TOKEN = "BLINK_RELAY_TOKEN"
PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
XLA_FLAGS = "XLA_FLAGS"
TF_CPP_VMODULE = "TF_CPP_VMODULE"
TF_CPP_MIN_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def get(name: str, default: str | None = None) -> str | None:
  """The value of a declared variable (or `default`)."""
  return os.environ.get(name, default)


def set(name: str, value: str) -> None:  # noqa: A001 - the verb
  os.environ[name] = value


def checkpoint_dir() -> Path | None:
  value = get(CHECKPOINT_DIR)
  return Path(value) if value else None


def command_buffers_disabled() -> bool:
  return get(NO_COMMAND_BUFFERS) == "1"


def host_min_graph_size(default: int) -> int:
  value = get(HOST_MIN_GRAPH_SIZE)
  return int(value) if value else default


def api_key() -> str | None:
  return get(API_KEY) or None


def relay_token() -> str | None:
  return get(RELAY_TOKEN)


def child_environment(set_vars: dict[str, str] | None = None,
                      drop: tuple[str, ...] = ()) -> dict[str, str]:
  """This process's environment for a child process, with `set_vars` set and `drop` unset."""
  out = {k: v for k, v in os.environ.items() if k not in drop}
  out.update(set_vars or {})
  return out
