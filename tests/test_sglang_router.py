"""SGLang's own router (`sglang-router`, unchanged) in front of two of our workers: the openai SDK
and native /generate work through it under each policy, cache_aware keeps shared prefixes on one
worker (a higher prefix-hit rate than round_robin), and a dead worker is dropped."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

from router_utils import running_router
from server_utils import running_server, sse_events, start_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

ARGS = ("--max-total-tokens", "16384", "--max-running-requests", "32", "--enable-metrics")


@pytest.fixture(scope="module")
def workers(llama_model):
    with running_server(llama_model, *ARGS) as a, running_server(llama_model, *ARGS) as b:
        yield a, b


@pytest.fixture(scope="module")
def router(workers):
    with running_router([w.url for w in workers], "cache_aware") as url:
        yield url


def test_openai_sdk_chat_completions_stream_and_n2_through_the_router(router):
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Say something about licenses."}]
    chat = client.chat.completions.create(model="any-model-name", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    assert isinstance(chat.choices[0].message.content, str)
    two = client.chat.completions.create(model="x", messages=messages, max_tokens=4, n=2, temperature=0.7)
    assert [c.index for c in two.choices] == [0, 1]
    chunks = list(client.chat.completions.create(model="x", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content[: len(text)] and len(text) > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    comp = client.completions.create(model="x", prompt="The license", max_tokens=5, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="The license", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == comp.choices[0].text
    pair = client.completions.create(model="x", prompt="The license", max_tokens=3, n=2, temperature=0.9)
    assert sorted(c.index for c in pair.choices) == [0, 1]


def test_native_generate_batch_and_stream_through_the_router(router):
    """The router's /generate schema takes `text` as one string: a batch goes as `input_ids` lists."""
    params = {"max_new_tokens": 6, "temperature": 0}
    prompts = [[17, 230, 41, 9], [88, 12, 300]]
    resp = requests.post(router + "/generate", json={"input_ids": prompts, "sampling_params": params}, timeout=120)
    assert resp.status_code == 200, resp.text
    batch = resp.json()
    assert len(batch) == 2 and all(len(b["output_ids"]) == 6 for b in batch)
    single = requests.post(router + "/generate", json={"input_ids": prompts[0], "sampling_params": params},
                           timeout=120).json()
    assert single["output_ids"] == batch[0]["output_ids"]
    with requests.post(router + "/generate", json={"input_ids": prompts[0], "sampling_params": params,
                                                   "stream": True}, stream=True, timeout=120) as stream:
        assert stream.status_code == 200
        events = sse_events(stream)
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["output_ids"] == batch[0]["output_ids"] and final["meta_info"]["finish_reason"]["type"] == "length"
    text = requests.post(router + "/generate", json={"text": "The license", "sampling_params": params}, timeout=120)
    assert text.status_code == 200 and len(text.json()["output_ids"]) == 6


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two"])
def test_other_policies_serve_both_apis(workers, policy):
    with running_router([w.url for w in workers], policy) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        for _ in range(4):
            out = client.completions.create(model="m", prompt="The license", max_tokens=3, temperature=0)
            assert out.usage.completion_tokens == 3
        resp = requests.post(url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                             timeout=60)
        assert resp.status_code == 200, resp.text


def test_cache_aware_beats_round_robin_on_shared_prefixes(llama_model):
    import bench_router

    rows = {r["policy"]: r for r in _bench(bench_router, llama_model)}
    rr, ca = rows["round_robin"], rows["cache_aware"]
    assert rr["failed"] == ca["failed"] == 0 and rr["completed"] == ca["completed"] == 32
    assert ca["hit_rate"] > rr["hit_rate"], rows
    assert min(rr["queried_per_worker"]) > 0  # round robin really spread the work


def _bench(bench_router, model):
    out = Path(bench_router.tempfile.mkdtemp()) / "rows.json"
    rc = bench_router.main(["--model-path", str(model), "--groups", "4", "--per-group", "8", "--system-prompt-len",
                            "256", "--question-len", "16", "--output-len", "4", "--concurrency", "8",
                            "--json-out", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_a_dead_worker_is_dropped_and_the_other_keeps_serving(llama_model):
    a = start_server(llama_model, *ARGS)
    b = start_server(llama_model, *ARGS)
    try:
        with running_router([a.url, b.url], "round_robin") as url:
            b.proc.send_signal(signal.SIGKILL)
            b.proc.wait(10)
            deadline, served = time.monotonic() + 60, 0
            while served < 6 and time.monotonic() < deadline:
                try:
                    r = requests.post(url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                                      timeout=30)
                except requests.RequestException:
                    continue
                served += r.status_code == 200
            assert served == 6, "the surviving worker must serve every request once the dead one is dropped"
            assert a.alive()
    finally:
        a.stop()
        b.stop(2)
