"""bench/decode_buckets.py runs end to end on the CPU (the bundled 270M, two small bucket sets,
a few tokens): a row per set and concurrency, the first set the ratios' base."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_script_writes_a_row_per_set_and_concurrency(gemma_dir, tmp_path):
  out = tmp_path / "buckets.json"
  subprocess.run([sys.executable, "-m", "bench.decode_buckets", "--ckpt", str(gemma_dir),
                  "--sets", "1,8;1,2,8", "--concurrency", "1,2", "--prompt_tokens", "6",
                  "--new_tokens", "4", "--repeats", "1", "--rounds", "1", "--out", str(out)],
                 cwd=ROOT, check=True, timeout=600)
  doc = json.loads(out.read_text())
  rows = doc["results"]
  assert [(r["buckets"], r["streams"]) for r in rows] == [
      ("1,8", 1), ("1,8", 2), ("1,2,8", 1), ("1,2,8", 2)]
  assert all(r["ms_per_token_median"] > 0 and r["startup_s_median"] > 0 for r in rows)
  assert [r["ratio_to_first_set"] for r in rows[:2]] == [1.0, 1.0]
  assert doc["benchmark"] == "decode_buckets" and doc["git_revision"]
