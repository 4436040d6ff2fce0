"""Hostile requests against a real server: catastrophic stop regexes end (stop or length) without
slowing other clients, and huge bodies are refused by name while the server keeps serving.
The figures on a quiet machine are in docs/benchmarks.md (scripts/bench_evil.py)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import requests
from transformers import AutoTokenizer

from server_utils import running_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_evil import CATASTROPHIC, p50_one_token  # noqa: E402


@pytest.fixture(scope="module")
def server(llama_model):
    with running_server(llama_model) as handle:
        ids = AutoTokenizer.from_pretrained(llama_model).encode("a", add_special_tokens=False)
        assert len(ids) == 1
        handle.force_a = {str(ids[0]): 100}
        yield handle


def _long_request(server, **sampling):
    body = {"text": "Once", "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True,
                                                 "logit_bias": server.force_a, **sampling}}
    out = {}

    def run():
        r = requests.post(server.url + "/generate", json=body, timeout=300)
        out.update(status=r.status_code, answer=r.json())

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.mark.parametrize("pattern", CATASTROPHIC)
def test_catastrophic_stop_regex_ends_and_other_clients_keep_their_latency(server, pattern):
    """Against the same forced decode without stop patterns, measured side by side: the catastrophic
    pattern (beside a 3,000-character stop string) costs other clients at most 2x."""
    thread, plain = _long_request(server)
    p50_plain = p50_one_token(server.url, 1.0)
    thread.join()
    thread, evil = _long_request(server, stop=["z" * 3000], stop_regex=pattern)
    p50_evil = p50_one_token(server.url, 1.0)
    thread.join()
    assert plain["status"] == evil["status"] == 200, evil
    finish = evil["answer"]["meta_info"]["finish_reason"]["type"]
    assert finish in ("stop", "length")
    assert set(evil["answer"]["text"]) <= {"a"}
    assert p50_evil <= 2.0 * p50_plain + 0.005, (p50_evil, p50_plain)
    assert server.get("/health").status_code == 200


@pytest.mark.parametrize("name,path,body,needle", [
    ("stop_30mb", "/generate", {"text": "hi", "sampling_params": {"stop": "x" * (30 << 20)}}, "--max-stop-chars"),
    ("chat_900k", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": "a"}] * 900_000}, "--max-request-json-items"),
    ("logit_bias_1m", "/generate", {"text": "hi", "sampling_params": {"logit_bias": {str(i): 1 for i in range(10**6)}}},
     "--max-request-json-items"),
])
def test_huge_bodies_are_refused_naming_the_limit_while_health_answers(server, name, path, body, needle):
    data = json.dumps(body).encode()
    healthy = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            healthy.append(requests.get(server.url + "/health", timeout=30).status_code)

    poller = threading.Thread(target=poll)
    poller.start()
    r = requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120)
    stop.set()
    poller.join()
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text[:300]
    assert healthy and set(healthy) == {200}
    ok = requests.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                       timeout=60)
    assert ok.status_code == 200
