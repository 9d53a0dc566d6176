"""bench/sched.py on the CPU scheduler: its loop runs, keeps every lane decoding, and its
doorbell rings (`--doorbell_us`) make the schedule scan the slots with nothing new to find."""
from bench import sched as bench_sched


def test_doorbell_rings_make_scans_and_nothing_else():
  quiet = bench_sched.measure(lanes=2, slots=32, seconds=0.3, repeats=1)
  rung = bench_sched.measure(lanes=2, slots=32, seconds=0.3, repeats=1, doorbell_us=500)
  for row in (quiet, rung):
    # every lane decodes (a request that reached the end of its context was resubmitted),
    # nothing errored or was cancelled
    assert row["running"] == 2 and row["admitted"] >= 2
    assert row["errored"] == row["cancelled"] == 0
    assert row["tokens_per_iteration"][0] > 1.5
  assert rung["doorbell_us"] == 500 and quiet["doorbell_us"] == 0
  # the resubmissions' scans only, against one more every ~500 us (an iteration takes
  # microseconds)
  assert rung["slot_scans_per_iteration"] > 5 * quiet["slot_scans_per_iteration"] > 0
