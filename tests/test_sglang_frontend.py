"""SGLang's own frontend language (the `sglang` package, 0.4.10.post2, installed without its
dependencies by scripts/setup_env.sh) against our server: `gen(regex=...)` and
`gen(json_schema=...)` on a random-weight model give outputs that match."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import sglang as sgl

from server_utils import running_server

IPV4 = r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                           "kind": {"enum": ["a", "b"]}},
          "required": ["id", "kind"], "additionalProperties": False}


@sgl.function
def profile(s, i):
    s += f"Host {i} address: " + sgl.gen("ip", regex=IPV4, temperature=1.0, max_tokens=32)
    s += "\nRecord: " + sgl.gen("record", json_schema=json.dumps(SCHEMA), temperature=1.0, max_tokens=48)


@pytest.fixture(scope="module")
def backend(llama_model):
    with running_server(llama_model, "--max-total-tokens", "16384") as handle:
        endpoint = sgl.RuntimeEndpoint(handle.url)
        yield endpoint


def test_frontend_gen_regex_and_json_schema_against_our_server(backend):
    states = profile.run_batch([{"i": i} for i in range(20)], backend=backend, num_threads=4)
    ips = [st["ip"] for st in states]
    assert all(re.fullmatch(IPV4, ip) for ip in ips), ips
    for st in states:
        jsonschema.validate(json.loads(st["record"]), SCHEMA)
    assert len(set(ips)) > 5
