"""Summarises an `nsys stats --report cuda_gpu_kern_sum --format csv` file: GPU time per
kernel family (XLA fusion kinds, Triton GEMMs, our FFI kernels), per step and in total.

Usage: python scripts/kernel_time_summary.py kern_sum.csv [steps]
"""
from __future__ import annotations

import collections
import csv
import re
import sys


def family(name: str) -> str:
  """A kernel's family: its name without the numeric suffixes XLA adds."""
  name = name.split("(")[0].split("<")[0]
  return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+", "", name))


def main(path: str) -> None:
  with open(path) as f:
    rows = list(csv.DictReader(f))
  total = collections.Counter()
  count = collections.Counter()
  for r in rows:
    fam = family(r["Name"])
    total[fam] += float(r["Total Time (ns)"])
    count[fam] += int(r["Instances"])
  grand = sum(total.values())
  print(f"{path}: {sum(count.values())} kernel launches, {grand / 1e6:.1f} ms GPU time")
  print(f"{'family':48s} {'launches':>9s} {'total ms':>9s} {'share':>6s} {'avg us':>7s}")
  for fam, t in total.most_common(30):
    print(f"{fam[:48]:48s} {count[fam]:9d} {t / 1e6:9.2f} {t / grand:6.1%} {t / count[fam] / 1e3:7.2f}")


if __name__ == "__main__":
  for p in sys.argv[1:]:
    main(p)
