"""xla_flags: the GPU path of the flag setup runs on CPU too (with the plugin check faked)."""
import os
import sys

import pytest

from blink_jax.executor import xla_flags


def _configure(monkeypatch, xla_flags_env="", vmodule=None):
  monkeypatch.setattr(xla_flags, "cuda_plugin_installed", lambda: True)
  monkeypatch.setattr(xla_flags, "backend_started", lambda: False)
  monkeypatch.delenv("BLINK_NO_COMMAND_BUFFERS", raising=False)
  monkeypatch.setenv("XLA_FLAGS", xla_flags_env)
  if vmodule is None:
    monkeypatch.delenv("TF_CPP_VMODULE", raising=False)
  else:
    monkeypatch.setenv("TF_CPP_VMODULE", vmodule)
  return xla_flags.configure_command_buffers()


def test_gpu_configuration_sets_command_buffer_flags_and_log_modules(monkeypatch):
  assert _configure(monkeypatch, "--xla_foo=1")
  flags = os.environ["XLA_FLAGS"].split()
  assert flags[0] == "--xla_foo=1"
  assert set(xla_flags.command_buffer_flags()) <= set(flags)
  assert "--xla_disable_hlo_passes=dot-strength-reduction" in flags
  assert "WHILE" in xla_flags.COMMAND_TYPES and "CONDITIONAL" in xla_flags.COMMAND_TYPES
  assert os.environ["TF_CPP_VMODULE"].split(",") == list(xla_flags.VMODULES)


def test_gpu_configuration_keeps_the_users_settings(monkeypatch):
  mine = ("--xla_gpu_enable_command_buffer=FUSION --xla_gpu_graph_min_graph_size=5 "
          "--xla_disable_hlo_passes=foo")
  assert _configure(monkeypatch, mine, vmodule="command_buffer_thunk=1,foo=3")
  assert os.environ["XLA_FLAGS"] == mine
  assert os.environ["TF_CPP_VMODULE"] == "command_buffer_thunk=1,foo=3,command_buffer_conversion_pass=2"


def test_no_command_buffers_when_the_backend_already_runs(monkeypatch):
  monkeypatch.setattr(xla_flags, "cuda_plugin_installed", lambda: True)
  monkeypatch.setattr(xla_flags, "backend_started", lambda: True)
  monkeypatch.setenv("XLA_FLAGS", "")
  assert not xla_flags.configure_command_buffers()
  assert os.environ["XLA_FLAGS"] == ""


def test_a_running_backend_without_the_decode_flag_still_has_command_buffers(monkeypatch):
  monkeypatch.setattr(xla_flags, "cuda_plugin_installed", lambda: True)
  monkeypatch.setattr(xla_flags, "backend_started", lambda: True)
  monkeypatch.delenv("BLINK_NO_COMMAND_BUFFERS", raising=False)
  monkeypatch.setenv("XLA_FLAGS", " ".join(xla_flags.command_buffer_flags()))
  assert xla_flags.configure_command_buffers()


class _Compiled:
  """The part of a compiled executable the loop report reads: its HLO text."""

  def as_text(self):
    return "HloModule m\n\nENTRY main {\n  while.7 = (s32[]) while(p), condition=c, body=b\n}\n"


class _Gpu:
  platform = "gpu"


CONVERSION_LINE = ("I1201 command_buffer_conversion_pass.cc:1] Creating command buffer thunk "
                   "with the following thunks: while.7")


@pytest.mark.parametrize("min_level,log,want", [
    ("0", CONVERSION_LINE, True),   # the loop went into a command buffer
    ("0", "", False),               # the log is on and says nothing: no command buffer
    ("1", "", None),                # INFO dropped: unknown, not "no"
    ("", "", False)])
def test_loop_report_reads_the_conversion_log_only_when_xla_writes_it(
    monkeypatch, min_level, log, want):
  from blink_jax.executor.loop_report import command_buffer_report
  monkeypatch.setenv("TF_CPP_VMODULE", "command_buffer_conversion_pass=2")
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", min_level)
  report = command_buffer_report(_Compiled(), log, _Gpu(), "persistent")
  assert report["device_while"] is want
  assert report["loop"] == "while.7"


def test_filtered_stderr_drops_xla_info_lines_as_they_come(capfd):
  """serve.py's start-up: XLA's INFO lines and the command-buffer log do not reach stderr
  (the jax logger at WARNING, serve.py's default); warnings and other lines do, as written,
  and fd 2 is the real stderr again after the block."""
  import logging
  import os
  from blink_jax.executor import loop_report
  jax_log = logging.getLogger("jax")
  level = jax_log.level
  jax_log.setLevel(logging.WARNING)
  try:
    before = os.fstat(2).st_ino
    with loop_report.filtered_stderr():
      os.write(2, b"I1204 17:09:20.116656  994 service.cc:154] XLA service initialized\n")
      os.write(2, b"I1204 17:09:20.235852  994 command_buffer_conversion_pass.cc:564] x\n")
      os.write(2, b"W1204 17:09:21.000000  994 gpu_helpers.cc:1] a warning\n")
      os.write(2, b"plain text from a library\n")
      print("python's own stderr", file=sys.stderr)
    assert os.fstat(2).st_ino == before
    err = capfd.readouterr().err
    assert "XLA service initialized" not in err and "command_buffer_conversion" not in err
    assert "a warning" in err and "plain text from a library" in err
    assert "python's own stderr" in err
    jax_log.setLevel(logging.INFO)  # serve.py --verbosity=1: XLA's INFO lines too
    with loop_report.filtered_stderr():
      os.write(2, b"I1204 17:09:20.116656  994 service.cc:154] XLA service initialized\n")
    assert "XLA service initialized" in capfd.readouterr().err
  finally:
    jax_log.setLevel(level)
