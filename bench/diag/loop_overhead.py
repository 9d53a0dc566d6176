"""Which part of a device-side serving loop does host CPU interference reach?

Runs small `lax.while_loop`s for a fixed number of iterations, each quiet and under N
memory-thrashing processes, and reports the time per iteration and the ratio. Nothing in
these loops touches host memory (the scheduler's mailbox is in GPU memory), so a loop that
slows down under interference is paying for something the host does per iteration or per
kernel.

  python -m bench.diag.loop_overhead --interference 32 --iters 20000
"""
from __future__ import annotations

import os

from absl import app, flags

from blink_jax.executor import xla_flags
from bench import common as C
from bench.diag.loop_probes import measure

FLAGS = flags.FLAGS
flags.DEFINE_integer("iters", 20000, "loop iterations per measurement")
flags.DEFINE_integer("interference", 32, "thrashing processes")
flags.DEFINE_integer("repeats", 3, "measurements per variant and level")
flags.DEFINE_list("variants", ["trivial", "kernels20", "switch", "ffi_s", "ffi_sc", "ffi_c",
                                "ffi_ss", "ffi_cc", "ffi_sc_top1"],
                  "loops to measure")
flags.DEFINE_string("out", "bench/results/loop_overhead.json", "JSON result file")
flags.DEFINE_string("dump_hlo", None, "write each variant's optimized HLO into this folder")
flags.DEFINE_bool("command_buffers", True, "set XLA's command-buffer flags (device-side WHILE)")
flags.DEFINE_string("xla_extra", "", "more XLA flags for this run, e.g. "
                    "--xla_gpu_enable_dynamic_slice_fusion=false")


def main(argv):
  del argv
  if FLAGS.xla_extra:  # before the backend starts (importing jax does not start it)
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), FLAGS.xla_extra]).strip()
  if FLAGS.command_buffers:
    xla_flags.configure_command_buffers()
  levels = [0] + ([FLAGS.interference] if FLAGS.interference else [])
  rows = []
  for v in FLAGS.variants:
    rows += [dict(r, command_buffers=FLAGS.command_buffers, xla_extra=FLAGS.xla_extra)
             for r in measure(v, levels, FLAGS.iters, FLAGS.repeats, FLAGS.dump_hlo)]
    print(rows[-1], flush=True)
  print(C.table(rows, ["variant", "device_while", "interference", "us_per_iter_median",
                       "us_per_iter_min", "us_per_iter_max", "ratio", "kernel_us_per_iter_median",
                       "hlo_copies", "unaliased_ffi_calls"]))
  C.write_result(FLAGS.out, "loop_overhead", rows,
                 {"iters": FLAGS.iters, "command_buffer_types": xla_flags.command_types()})


if __name__ == "__main__":
  app.run(main)
