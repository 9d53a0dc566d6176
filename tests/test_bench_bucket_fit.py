"""bench/bucket_fit.py runs end to end on the CPU (the bundled 270M, one 9-token prompt, two
tokens): a row per prompt length with both settings' TTFT and the same tokens from both."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_script_writes_a_row_per_prompt_length(gemma_dir, tmp_path):
  out = tmp_path / "fit.json"
  subprocess.run([sys.executable, "-m", "bench.bucket_fit", "--ckpt", str(gemma_dir),
                  "--prompt_lengths", "9", "--new_tokens", "2", "--repeats", "1",
                  "--rounds", "1", "--out", str(out)], cwd=ROOT, check=True, timeout=600)
  doc = json.loads(out.read_text())
  rows = doc["results"]
  assert [r["prompt_tokens"] for r in rows] == [9]
  for r in rows:
    assert r["ttft_ms_fit_median"] > 0 and r["ttft_ms_padded_median"] > 0, r
    assert r["ratio_fit_to_padded"] > 0 and r["same_tokens"] is True, r
  assert doc["benchmark"] == "bucket_fit" and doc["git_revision"] and doc["buckets"]
