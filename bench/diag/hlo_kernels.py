"""Counts the kernels of each bucket branch of a compiled serving loop (optimized HLO text).

At batch 1 the model step is bound by its kernel count: inside a CUDA graph each kernel
costs a few microseconds however little it does (the 1B bucket-1 branch had 753 kernels,
about 2.8 us each, finding 18 in docs/NOTES.md). Used by bench/diag/dump_engine_hlo.py.
"""
from __future__ import annotations

import collections
import re

# Instructions that launch nothing.
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
         "opt-barrier", "partition-id", "replica-id"}
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTR = re.compile(r"^(?:ROOT )?%?[\w.\-]+ = .*? ([\w\-]+)\(")


def computations(hlo: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines."""
  comps: dict[str, list[str]] = {}
  cur = None
  for line in hlo.splitlines():
    m = _HEADER.match(line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
    elif line.startswith("}"):
      cur = None
    elif cur is not None:
      comps[cur].append(line.strip())
  return comps


def _kind(line: str, op: str) -> str:
  if op == "fusion":
    calls = re.search(r"calls=%?([\w.\-]+)", line)
    if calls and "gemm" in calls.group(1):
      return "gemm fusion"
    kind = re.search(r"kind=(\w+)", line)
    return f"fusion {kind.group(1) if kind else ''}".strip()
  if op == "custom-call":
    target = re.search(r'custom_call_target="([^"]+)"', line)
    return f"custom-call {target.group(1) if target else ''}".strip()
  return op


def _branches(line: str) -> list[str]:
  m = re.search(r"branch_computations=\{([^}]*)\}", line)
  if m:
    return [b.strip().lstrip("%") for b in m.group(1).split(",")]
  return [m.group(1) for m in re.finditer(r"(?:true|false)_computation=%?([\w.\-]+)", line)]


def kernels(comps: dict[str, list[str]], name: str, pick=min) -> collections.Counter:
  """Kernels one execution of computation `name` launches; a nested conditional counts as
  its smallest branch (`pick=min`: greedy sampling without logprobs skips the sampling and
  logprob branches) or its largest (`pick=max`, an upper bound)."""
  out: collections.Counter = collections.Counter()
  for line in comps.get(name, []):
    m = _INSTR.match(line)
    if not m or m.group(1) in _FREE:
      continue
    op = m.group(1)
    if op == "conditional":
      nested = [kernels(comps, b, pick) for b in _branches(line)]
      out += pick(nested, key=lambda c: sum(c.values()), default=collections.Counter())
    else:
      out[_kind(line, op)] += 1
  return out


def launches(comps: dict[str, list[str]], name: str) -> list[str]:
  """The kernels of computation `name` in program order, one line each (kind, instruction,
  result shape); a nested conditional is one line (its branches are not expanded)."""
  out = []
  for line in comps.get(name, []):
    m = _INSTR.match(line)
    if not m or m.group(1) in _FREE:
      continue
    result = re.match(r"(?:ROOT )?%?([\w.\-]+) = (\S+)", line)
    kind = "conditional" if m.group(1) == "conditional" else _kind(line, m.group(1))
    out.append(f"{kind:32} {result.group(1):44} {result.group(2)[:60]}")
  return out


def switch_branches(hlo: str, pick=min) -> list[tuple[str, collections.Counter]]:
  """(branch computation, kernels) of the loop's bucket switch (empty step, then one branch
  per bucket in order): the indexed conditional with the most branches (the nested
  `lax.cond`s are predicated, true/false)."""
  comps = computations(hlo)
  best: list[str] = []
  for lines in comps.values():
    for line in lines:
      if (" conditional(" in line and "branch_computations=" in line
          and len(_branches(line)) > len(best)):
        best = _branches(line)
  return [(b, kernels(comps, b, pick)) for b in best]
