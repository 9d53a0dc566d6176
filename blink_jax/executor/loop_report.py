"""Whether the serving loop runs as a device-side WHILE node, read from XLA's own log.

XLA logs (at the verbosities `xla_flags.configure_command_buffers` sets) which thunks it put
into command buffers, and when it runs a command buffer op by op; this module captures that
log instead of printing it (docs/ARCHITECTURE.md, "CUDA-graph rules").
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading

from blink_jax import env

# What XLA logs (command_buffer_thunk at verbosity 2) when it executes a command buffer op by
# op: its first execution, or the first after XLA evicted its CUDA graphs, which it does for
# every executable in the process whenever a new executable is created.
XLA_OP_BY_OP_LINE = "Executing warm up iteration of command buffer thunk"


# absl's log line prefix: severity letter, then MMDD.
_ABSL_INFO = re.compile(r"^I\d{4} ")


def _pass_through(line: str) -> bool:
  """Whether a captured line goes on to stderr: never the command-buffer lines this module
  reads; XLA's INFO lines (the conversion log asks for TF_CPP_MIN_LOG_LEVEL=0) only when the
  "jax" logger is at INFO (serve.py --verbosity=1); warnings, errors and anything else
  always."""
  if "command_buffer_conversion_pass" in line or "command_buffer_thunk" in line:
    return False
  return not _ABSL_INFO.match(line) or logging.getLogger("jax").isEnabledFor(logging.INFO)


@contextlib.contextmanager
def capture_stderr():
  """Captures what native code writes to fd 2 (XLA's logs) and passes it through afterwards."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), 2)
    text = {"value": ""}
    try:
      yield lambda: text["value"]
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      text["value"] = tmp.read().decode(errors="replace")
      kept = [l for l in text["value"].splitlines() if _pass_through(l)]
      if kept:
        sys.stderr.write("\n".join(kept[-50:]) + "\n")


@contextlib.contextmanager
def filtered_stderr():
  """While open, everything written to fd 2 (XLA's C++ logs, Python's) reaches the real
  stderr line by line as it comes, less what `_pass_through` drops: serve.py's start-up,
  where XLA's INFO lines (TF_CPP_MIN_LOG_LEVEL=0, which the conversion log needs) would
  fill the server's log. A thread reads a pipe that stands in for fd 2; it closes with the
  block, so processes started after it (the frontend workers) write to the real stderr."""
  sys.stderr.flush()
  saved = os.dup(2)
  read_end, write_end = os.pipe()
  os.dup2(write_end, 2)
  os.close(write_end)

  def pump():
    with os.fdopen(read_end, "rb") as pipe:
      for raw in pipe:
        if _pass_through(raw.decode(errors="replace").rstrip("\n")):
          try:
            os.write(saved, raw)
          except OSError:  # the block ended while a child kept the pipe open: stop
            return

  thread = threading.Thread(target=pump, name="stderr-filter", daemon=True)
  thread.start()
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)  # the pipe's last write end: the thread reads to its end, then stops
    thread.join(5.0)
    os.close(saved)


def command_buffer_report(compiled, compile_log: str, device, mode: str) -> dict:
  """Whether XLA put the serving loop's top-level while into a command buffer (a CUDA graph
  with a device-side WHILE node), read from XLA's own log of the conversion."""
  if mode != "persistent":
    return {"device_while": False, "reason": "host mode: Python drives every step"}
  if device.platform != "gpu":
    return {"device_while": False, "reason": "CPU backend: the loop runs in XLA's CPU runtime"}
  text = compiled.as_text()
  entry = text[text.find("ENTRY"):]
  m = re.search(r"(while(?:\.\d+)?) = .* while\(", entry)
  if m is None:
    return {"device_while": None, "reason": "no while loop in the entry computation"}
  name = m.group(1)
  lines = [l for l in compile_log.splitlines() if "Creating command buffer thunk" in l]
  # The pass logs at INFO (VLOG): a minimum log level above 0 drops it even when asked for.
  log_on = ("command_buffer_conversion_pass" in env.get(env.TF_CPP_VMODULE, "")
            and env.get(env.TF_CPP_MIN_LOG_LEVEL, "0") in ("", "0"))
  if not lines and not log_on:
    return {"device_while": None, "loop": name,
            "reason": "XLA's conversion log is off (call xla_flags.configure_command_buffers() "
                      "before JAX starts, with TF_CPP_MIN_LOG_LEVEL unset or 0)"}
  hit = [l for l in lines if re.search(rf"\b{re.escape(name)}\b", l.split("thunks:")[-1])]
  return {"device_while": bool(hit), "loop": name,
          "evidence": hit[0].split("] ")[-1][:200] if hit else
          f"{len(lines)} command buffers, none holds {name}"}
