"""schemathesis against the gateway's own ``/openapi.json``, over real HTTP, with a real decode
worker (a tiny random Llama) answering the generation endpoints: with a fixed example budget and
derandomized generation, no request it makes, valid or not, gets a 5xx, and every response
conforms to the schema (status, content type, headers, body), invalid requests are refused, and
the API key is enforced where the schema says it is."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from baton.common.index.server import EmbeddedRedis
from baton.common.net import free_port
from baton.services.gateway.app import GatewayConfig
from tests.e2e.tiny_gateway import build_tiny_llama, decode_worker, gateway

KEY = "sk-schemathesis"
EXAMPLES = {"POST /v1/completions": 30, "POST /v1/chat/completions": 30}
"""Examples per operation and generation mode: the generation endpoints take the most input."""
OTHER_EXAMPLES = 10
MAX_MODEL_LEN = 64
"""Small, so that a request without max_tokens ends within a few dozen tokens and a large
max_tokens is refused at once."""
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    redis = EmbeddedRedis()
    url = redis.start()
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = GatewayConfig(
        port=free_port(),
        model=str(model),
        redis_url=url,
        api_keys=(KEY,),
        max_choices=4,
        max_body_bytes=256 * 1024,
        log_level="warning",
    )
    try:
        with decode_worker(model, url, MAX_MODEL_LEN), gateway(config) as base:
            yield base
    finally:
        redis.stop()


OPERATIONS = {
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /health",
    "GET /ready",
    "GET /metrics",
    "GET /workers",
}


def _fuzz(operation, mode: GenerationMode) -> None:
    """``EXAMPLES`` cases of ``operation`` in ``mode``, each sent and checked; the first failing
    case fails the test with schemathesis' report (not shrunk, to keep the run bounded)."""
    examples = EXAMPLES.get(operation.label, OTHER_EXAMPLES)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case) -> None:
        case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, checks=CHECKS, timeout=60)

    one()


def test_gateway_conforms_to_its_schema(base_url):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} == OPERATIONS
    for operation in operations:
        _fuzz(operation, GenerationMode.POSITIVE)
        if operation.body or operation.path_parameters:
            _fuzz(operation, GenerationMode.NEGATIVE)
