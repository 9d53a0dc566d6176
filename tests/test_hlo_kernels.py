"""bench/diag/hlo_kernels.py: kernel counts per bucket branch of a compiled loop."""
import jax.numpy as jnp
from flax import nnx

from blink_jax import Engine
from blink_jax.model.config import tiny_config
from blink_jax.model.gemma import Gemma
from bench.diag import hlo_kernels as H

HLO = """
%small (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %f = f32[2]{0} fusion(%p), kind=kLoop, calls=%fused_a
}

%big (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  %f1 = f32[2]{0} fusion(%p), kind=kLoop, calls=%fused_b
  %f2 = f32[2]{0} fusion(%f1), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  ROOT %c = f32[2]{0} custom-call(%f2), custom_call_target="blink_commit"
}

%branch_1 (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  %i = pred[] constant(true)
  %n = f32[2]{0} conditional(%i, %p, %p), true_computation=%big, false_computation=%small
  ROOT %r = f32[2]{0} fusion(%n), kind=kInput, calls=%fused_reduce
}

%branch_0 (p: f32[2]) -> f32[2] {
  ROOT %p = f32[2]{0} parameter(0)
}

ENTRY %main (p: f32[2], i: s32[]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %s = f32[2]{0} conditional(%i, %p, %p), branch_computations={%branch_0, %branch_1}
}
"""


def test_nested_conditionals_count_their_smallest_or_largest_branch():
  (b0, k0), (b1, k1) = H.switch_branches(HLO)
  assert (b0, b1) == ("branch_0", "branch_1")
  assert sum(k0.values()) == 0
  assert k1 == {"fusion kInput": 1, "fusion kLoop": 1}
  (_, big), = H.switch_branches(HLO, max)[1:]
  assert big == {"fusion kInput": 1, "fusion kLoop": 1, "gemm fusion": 1,
                 "custom-call blink_commit": 1}


def test_launches_lists_kernels_in_program_order():
  lines = H.launches(H.computations(HLO), "big")
  assert [l.split()[0:2] for l in lines] == [["fusion", "kLoop"], ["gemm", "fusion"],
                                              ["custom-call", "blink_commit"]]
  assert lines[0].split()[-2:] == ["f1", "f32[2]{0}"]
  assert H.launches(H.computations(HLO), "branch_1")[0].startswith("conditional")


def test_cpu_engine_loop_runs_buckets_as_while_loops_not_a_switch():
  # The kernel counts read the GPU loop's bucket switch. Off the GPU there is none: each bucket
  # branch is a while loop that runs 0 or 1 times (docs/ARCHITECTURE.md, "The persistent
  # loop"), inside the serving loop's own while.
  cfg = tiny_config("gemma3", vocab_size=256)
  model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
  with Engine(model, None, max_seqs=4, page_size=4, max_context=64, buckets=(4, 16)) as eng:
    hlo = eng.compiled.as_text()
  # (The step's lax.conds, true/false, remain: none has the 3 branches of empty + 2 buckets.)
  assert len(H.switch_branches(hlo)) <= 2
  assert sum(" while(" in line for line in hlo.splitlines()) >= 1 + 2
