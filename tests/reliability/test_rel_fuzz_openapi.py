"""Schema-driven fuzzing: schemathesis reads the server's own /openapi.json and throws generated
requests (valid and invalid, per the schema) at a real `blink serve --model null`.

Checks: no 5xx, every status one the document lists, JSON where it says JSON, bodies matching
the response schemas; and afterwards the server still serves. Deterministic (derandomized
Hypothesis) and short enough for CI.
"""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                         status_code_conformance)

from bench.reliability import ServeUnderTest, http_get  # noqa: E402
from rel_procs import post  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = {"POST": 100, "GET": 10}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServeUnderTest(f"blink-test-fuzz-{id(tmp_path_factory)}",
                       ["--model", "null", "--slots", "64", "--max-tokens-limit", "32"],
                       tmp_path_factory.mktemp("fuzz") / "serve.log", ready_timeout_s=120)
    yield s
    assert s.stop() == 0, s.log_path.read_text()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base + "/openapi.json")


# (method, path, mode): GETs take no input, so they have no invalid variant to generate.
CASES = [("POST", "/v1/completions", "positive"), ("POST", "/v1/completions", "negative"),
         ("POST", "/v1/chat/completions", "positive"), ("POST", "/v1/chat/completions", "negative"),
         ("GET", "/v1/models", "positive"), ("GET", "/health", "positive"), ("GET", "/metrics", "positive")]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_generated_requests_never_get_a_5xx(api_schema, server, method, path, mode):
    # Driven by hand rather than through schemathesis' pytest plugin (not compatible with pytest 9).
    from hypothesis import given
    from schemathesis import GenerationMode
    ops = [r.ok() for r in api_schema.get_all_operations()]
    op = next(o for o in ops if o.method.upper() == method and o.path == path)
    strategy = op.as_strategy(generation_mode=GenerationMode.POSITIVE if mode == "positive"
                              else GenerationMode.NEGATIVE)
    seen = []

    @settings(max_examples=EXAMPLES[method], derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case):
        response = case.call(base_url=server.base, timeout=30)
        seen.append(response.status_code)
        case.validate_response(response, checks=CHECKS)

    fuzz()
    assert seen and max(seen) < 500


def test_the_document_describes_the_real_routes(server):
    import json
    status, body = http_get(server.base + "/openapi.json")
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])
    comp = doc["components"]["schemas"]["CompletionRequest"]
    assert comp["additionalProperties"] is False and comp["required"] == ["prompt"]
    assert comp["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 32       # the server's own limit


def test_still_serving_after_the_fuzz(server):
    status, reply, _ = post(server.base, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 4
    assert http_get(server.base + "/health")[0] == 200
    m = server.metrics()
    assert not any("internal_error" in k and v for k, v in m.items())
    assert server.proc.poll() is None


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 4,
                         "stream_options": {"include_usage": True}})])
def test_a_stream_matches_the_documented_events(api_schema, server, path, body):
    """Every generated case above that streams is checked event by event against the document's
    text/event-stream schema; this one always streams, so the check does not depend on what the
    generator happens to draw."""
    op = next(r.ok() for r in api_schema.get_all_operations()
              if r.ok().method.upper() == "POST" and r.ok().path == path)
    case = op.Case(body=body, media_type="application/json")
    response = case.call(base_url=server.base, timeout=30)
    assert response.status_code == 200 and "text/event-stream" in response.headers["content-type"][0]
    case.validate_response(response, checks=CHECKS)
