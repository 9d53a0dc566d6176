"""Schemathesis against the frontend's own OpenAPI document (GET /openapi.json), as vLLM's CI
fuzzes its server: a worker over the fake device; every operation of the document with bodies
that fit its schemas and bodies that break them. Checks: never a 5xx, every status and body as
the document says (the errors in OpenAI's schema), no call hangs (each has a timeout); then
the worker still answers a completion exactly.
"""
from __future__ import annotations

import time

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance, response_schema_conformance, status_code_conformance)

from tests import fake_device as FD  # noqa: E402
from tests.test_frontend_hostile import API_KEY, start_worker  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
EXAMPLES = {"positive": 100, "negative": 100}  # per operation
CALL_TIMEOUT_S = 15


@pytest.fixture(scope="module")
def worker(tokenizer_path, tmp_path_factory):
  with FD.running_device(tokenizer_path) as fake:
    fake.tokenizer_path = tokenizer_path
    w = start_worker(tmp_path_factory.mktemp("fuzz"), fake, {}, api_key=API_KEY)
    try:
      yield w
    finally:
      w.stop()


def test_openapi_document(worker):
  s, h, doc = worker.http("GET", "/openapi.json")
  assert s == 200 and h["Content-Type"].startswith("application/json")
  assert doc["openapi"].startswith("3.1")
  assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}",
          "/health", "/metrics", "/openapi.json"} <= set(doc["paths"])
  req = doc["components"]["schemas"]["CompletionRequest"]
  assert req["required"] == ["prompt"]
  # The engine's limits are in it: the token ids of this vocabulary, its prompt capacity.
  ids = req["properties"]["prompt"]["anyOf"][2]
  assert ids["items"]["maximum"] == worker.fake.tokenizer.vocab_size - 1
  assert ids["maxItems"] == min(192, 256 - 1)
  assert req["properties"]["temperature"]["maximum"] == 2.0
  assert req["properties"]["presence_penalty"]["enum"] == [None, 0]


@pytest.mark.slow
def test_fuzz_with_schemathesis(worker):
  base = f"http://127.0.0.1:{worker.port}"
  schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
  auth = {"Authorization": f"Bearer {API_KEY}"}
  calls: dict[str, dict[int, int]] = {}  # operation: {status: count}
  t0 = time.monotonic()
  for result in schema.get_all_operations():
    op = result.ok()
    for mode, n in EXAMPLES.items():
      strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

      @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))
      @given(case=strategy)
      def run(case):
        r = case.call_and_validate(base_url=base, headers=auth, checks=CHECKS,
                                   timeout=CALL_TIMEOUT_S)
        seen = calls.setdefault(op.label, {})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1

      try:
        run()
      except Unsatisfiable:
        assert mode == "negative", op.label  # nothing of it to break (no parameters)
  took = time.monotonic() - t0
  print(f"schemathesis: {sum(sum(c.values()) for c in calls.values())} calls in {took:.1f} s: "
        f"{calls}")
  # (Schemathesis leaves out the document's own operation, GET /openapi.json.)
  assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
          "GET /v1/models/{model}", "GET /health", "GET /metrics"} <= set(calls), calls
  for op in ("POST /v1/completions", "POST /v1/chat/completions"):  # generated, and refused
    assert calls[op].get(200) and calls[op].get(400), calls[op]
  # Afterwards: healthy, and a completion is exactly the story's continuation.
  assert worker.http("GET", "/health")[0] == 200
  s, _, b = worker.http("POST", "/v1/completions", {"prompt": [2, 4, 6], "max_tokens": 6})
  assert s == 200 and b["choices"][0]["text"] == worker.expected(3, 6), b
  assert "Traceback" not in worker.log_text()
