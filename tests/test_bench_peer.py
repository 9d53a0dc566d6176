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
