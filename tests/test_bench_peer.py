"""The peer's model folder (bench/peer.py): a transformers config in the project's
shape and a tokenizer with the bundled model's token ids, which vLLM serves beside
blink-jax's `random:<shape>` (issue 27)."""
import pytest

from blink_jax.client.tokenizer import Tokenizer
from blink_jax.model.config import get_config


@pytest.mark.parametrize("shape", ["gemma3-270m"])
def test_peer_model_dir_has_the_shape_and_the_token_ids(shape, gguf_file, gemma_dir, tmp_path):
  transformers = pytest.importorskip("transformers")
  from bench.peer import write_model_dirs

  out = write_model_dirs([shape], tmp_path / "peer", gguf=gguf_file)
  cfg = get_config(shape)
  hf = transformers.AutoConfig.from_pretrained(out / shape)
  assert hf.architectures == ["Gemma3ForCausalLM"]
  assert (hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
          hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.sliding_window) == (
              cfg.vocab_size, cfg.d_model, cfg.ffw_hidden, cfg.num_layers, cfg.num_heads,
              cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
  assert [t == "full_attention" for t in hf.layer_types] == [
      cfg.is_global(i) for i in range(cfg.num_layers)]
  ours = Tokenizer(str(gemma_dir / "tokenizer.model"))
  theirs = transformers.AutoTokenizer.from_pretrained(out / "tokenizer")
  for text in ["The capital of France is", "naïve café, 東京 🙂", "  two  spaces\nand a line"]:
    assert theirs(text)["input_ids"] == ours.encode(text, add_bos=True), text
  assert hf.eos_token_id == 1 and hf.bos_token_id == 2


def test_server_info_reads_version_and_settings_from_a_vllm_log():
  from bench.peer import server_info
  log = """INFO 12-02 10:00:00 [api_server.py:1] vLLM API server version 0.26.0
INFO 12-02 10:00:00 [utils.py:2] non-default args: {'model': '/tmp/m', 'load_format': 'dummy', 'max_num_seqs': 256}
INFO 12-02 10:00:01 [config.py:3] Chunked prefill is enabled with max_num_batched_tokens=8192.
INFO 12-02 10:00:30 [worker.py:4] Some unrelated line
INFO 12-02 10:01:00 [kv_cache_utils.py:5] GPU KV cache size: 1,234,567 tokens
"""
  info = server_info("vllm", log)
  assert info["server"] == "vllm" and info["version"] == "0.26.0"
  assert len(info["settings"]) == 4 and not any("unrelated" in s for s in info["settings"])
  # vLLM 0.26's banner puts the version after ASCII art; its engine's config line has it too.
  engine = "(EngineCore pid=9) INFO [core.py:116] Initializing a V1 LLM engine (v0.26.0) with config: x"
  assert server_info("vllm", engine)["version"] == "0.26.0"
  assert server_info("vllm", "Capturing CUDA graphs (PIECEWISE):  4%|")["settings"] == []
  assert server_info("blink", "x blink.serve: engine up in 3.0s\n")["settings"] == [
      "x blink.serve: engine up in 3.0s"]


def test_crosscheck_runs_vllm_bench_serve_on_the_same_workload():
  from bench import crosscheck as CC
  cmd = CC.vllm_command("http://127.0.0.1:8123/v1", "random:gemma3-1b", "/tok", 200, 16.0,
                        512, 256, 7, "/tmp/r")
  args = dict(zip(cmd[5::1], cmd[6::1]))
  assert cmd[2:5] == ["vllm.entrypoints.cli.main", "bench", "serve"]
  # The server's root (vLLM appends the endpoint), fixed lengths, the same rate and seed.
  assert args["--base-url"] == "http://127.0.0.1:8123" and args["--endpoint"] == "/v1/completions"
  assert (args["--random-input-len"], args["--random-output-len"], args["--random-range-ratio"],
          args["--num-prompts"], args["--request-rate"], args["--seed"]) == (
              "512", "256", "0", "200", "16.0", "7")
  assert "--ignore-eos" in cmd and args["--temperature"] == "0"
  cmp = CC.compare({"output_throughput": 1000.0, "p99_ttft_ms": 40.0, "completed": 200},
                   {"output_throughput": 950.0, "p99_ttft_ms": 44.0, "completed": 200})
  assert cmp["output_throughput"]["ratio"] == 0.95 and cmp["p99_ttft_ms"]["ratio"] == 1.1
  assert cmp["completed"]["ratio"] == 1.0 and cmp["mean_tpot_ms"]["ratio"] is None
  # Rounds alternate the tools, and the medians of each tool's runs are compared.
  assert [CC.round_order(k) for k in range(3)] == [("vllm", "ours"), ("ours", "vllm"),
                                                   ("vllm", "ours")]
  med = CC.median_run([{"mean_tpot_ms": 4.0, "completed": 100}, {"mean_tpot_ms": 6.0},
                       {"mean_tpot_ms": 5.5, "completed": 98}])
  assert med["mean_tpot_ms"] == 5.5 and med["completed"] == 99.0 and med["p99_itl_ms"] is None
  from bench import common as C
  assert "[4.000, 6.000]" in C.table([{"metric": "mean_tpot_ms", "runs": [4.0, 6.0]}],
                                 ["metric", "runs"])


def test_serving_report_puts_the_servers_side_by_side(tmp_path):
  import json
  from bench import serving_report as SR

  def doc(tput, ttft99, tpot99, joules):
    row = {"rate": 8.0, "output_throughput": tput, "ttft_ms_p50": ttft99 / 2,
           "ttft_ms_p99": ttft99, "tpot_ms_p50": tpot99 / 2, "tpot_ms_p99": tpot99,
           "energy_per_token_j": joules, "host_cpu_s_per_1k_tokens": 0.5,
           "engine_cpu_s_per_1k_tokens": 0.25}
    return {"results": [row]}
  files = {"persistent_quiet": doc(3000, 100, 2.0, 0.05), "vllm_quiet": doc(2000, 50, 4.0, 0.1),
           "persistent_int32": doc(3000, 110, 2.2, 0.05), "vllm_int32": doc(1000, 200, 20.0, 0.1),
           "host_single": {"results": [{"rate": "inf", "tpot_ms_p50": 3.0, "tpot_ms_p99": 3.5,
                                        "ttft_ms_p50": 20.0}]}}
  for name, d in files.items():
    (tmp_path / f"serving_h200_gemma3-1b_{name}.json").write_text(json.dumps(d))
  docs = SR.load(tmp_path, "serving_h200_")
  assert set(docs) == {("gemma3-1b", s, r) for s, r in (
      ("persistent", "quiet"), ("vllm", "quiet"), ("persistent", "int32"), ("vllm", "int32"),
      ("host", "single"))}
  table = SR.serving_table(docs, "gemma3-1b")
  assert len(table) == 2 + 4 and "| 8 | int32 | blink persistent | 3,000 |" in table[4]
  assert table[4].endswith("| 1.10, 1.10 |")  # interference over quiet, P99 TTFT and TPOT
  assert "| 0.050 | - |" in table[4]  # J per token; no tail without the field or requests
  # The tail from a file's saved requests (files older than bench.serving's tail_s): the last
  # answer's end (1.0 + 2.5 s) after the last send (2.0 s); a failed request counts as a send.
  saved = dict(input_len=8, max_tokens=4, error=None, ttft_s=None, output_tokens=0)
  reqs = [{**saved, "start_s": 1.0, "ok": True, "e2e_s": 2.5},
          {**saved, "start_s": 2.0, "ok": False, "e2e_s": None}]
  assert SR.tail_s({"requests": {"8.0": reqs}}, {"rate": 8.0}) == 1.5
  assert SR.tail_s({}, {"rate": 8.0, "tail_s": 0.7}) == 0.7
  # A TAG's thrasher run is compared with the same TAG's quiet run.
  assert [SR.quiet_of(r) for r in ("int32", "s49_int32", "int32_unpinned", "quiet",
                                   "s49_quiet", "single")] == [
                                       "quiet", "s49_quiet", "quiet", None, None, None]
  ratios = SR.vs_vllm(docs, "gemma3-1b")
  # vLLM's P99 over ours (>1: ours lower), our tokens/s over vLLM's, energy saved.
  assert "| 8 | quiet | 0.50x | 2.00x | 1.50x | +50 % | - | - |" in ratios
  assert "| 8 | int32 | 1.82x | 9.09x | 3.00x | +50 % | - | - |" in ratios
  # A lease's variants (TAG=f20: run f20_quiet) against its one vLLM run.
  docs[("gemma3-1b", "persistent", "f20_quiet")] = doc(2900, 120, 3.0, 0.08)
  ratios = SR.vs_vllm(docs, "gemma3-1b", vllm_run="quiet")
  assert "| 8 | f20_quiet | 0.42x | 1.33x | 1.45x | +20 % | - | - |" in ratios
  assert "| 8 | int32 | 0.45x | 1.82x | 1.50x | +50 % | - | - |" in ratios
  # The energy gap split: steps per token and J per busy step, ours over vLLM's.
  for key, ours, theirs in (("device_steps_per_output_token", 0.02, 0.025),
                            ("busy_energy_above_idle_per_step_j", 0.9, 0.75)):
    docs[("gemma3-1b", "persistent", "f20_quiet")]["results"][0][key] = ours
    docs[("gemma3-1b", "vllm", "quiet")]["results"][0][key] = theirs
  ratios = SR.vs_vllm(docs, "gemma3-1b", vllm_run="quiet")
  assert "| 8 | f20_quiet | 0.42x | 1.33x | 1.45x | +20 % | 0.80x | 1.20x |" in ratios
  assert "| gemma3-1b | blink host mode | 3.00 / 3.50 | 20.0 | - | - |" in SR.single_table(docs)
