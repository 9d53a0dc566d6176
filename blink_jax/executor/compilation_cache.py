"""JAX's persistent compilation cache for the serving loop (docs/ARCHITECTURE.md,
"Compilation cache").

The loop is most of an engine's start (the 1B's on an H100: 152 of 162 s compiling). With the
mailbox at the same address in every process (`client.mapping.MAILBOX_ADDRESS`) a restarted
engine of the same model, sizes and kernels lowers the same program, and JAX loads it from
the cache. What a cached loop lacks is XLA's compile log, from which `loop_report` tells
whether the loop became a device WHILE: the report of the compile that filled the cache is
kept beside it, keyed by the lowered program, and read back for a load.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pathlib

import jax

from blink_jax import env

log = logging.getLogger("blink_jax.executor")


def enable(path: str) -> str | None:
  """Makes `path` JAX's compilation cache folder unless the process has one already (set by
  the user, or by an earlier engine); the folder in use, or None when off."""
  current = jax.config.jax_compilation_cache_dir
  if current or not path:
    return current or None
  folder = pathlib.Path(path).expanduser()
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # a cache is an optimisation: the engine starts without it
    log.warning("no compilation cache: cannot create %s (%s)", folder, e)
    return None
  jax.config.update("jax_compilation_cache_dir", str(folder))
  return jax.config.jax_compilation_cache_dir


def active_dir() -> str | None:
  """JAX's compilation cache folder of this process, or None."""
  return jax.config.jax_compilation_cache_dir or None


def program_key(lowered_text: str, device) -> str:
  """What identifies a compiled loop beside JAX's own key: the lowered program, the device
  kind, the JAX version and the XLA flags it was compiled under."""
  h = hashlib.sha256()
  for part in (lowered_text, getattr(device, "device_kind", str(device)), jax.__version__,
               env.get(env.XLA_FLAGS, "")):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()


def _report_path(folder: str, key: str) -> pathlib.Path:
  return pathlib.Path(folder) / f"blink-loop-report-{key}.json"


def save_report(folder: str, key: str, report: dict) -> None:
  """Keeps a compile's loop report beside the cache (best effort: a cache folder that cannot
  be written loses only the report)."""
  try:
    _report_path(folder, key).write_text(json.dumps(report))
  except OSError as e:
    log.warning("could not keep the loop report in %s: %s", folder, e)


def load_report(folder: str, key: str) -> dict | None:
  """The report kept for this program, marked as read back, or None."""
  try:
    report = json.loads(_report_path(folder, key).read_text())
  except (OSError, ValueError):
    return None
  return {**report, "compiled": "loaded from the compilation cache; the report is its compile's"}
