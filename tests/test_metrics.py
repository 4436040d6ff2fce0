"""`GET /metrics` on a real server process: Prometheus text, SGLang names, counters that move."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import requests
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from server_utils import running_server

from managers.tokenizer_metrics import LatencyHistogram
from srt.entrypoints.http_server import create_app
from srt.entrypoints.metrics import GenThroughput, _cumulative_buckets
from srt.entrypoints.server_state import ServerState
from srt.server_args import ServerArgs

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
MODEL_NAME = "tiny-metrics"
SERVER_ARGS = ("--served-model-name", MODEL_NAME)  # plus server_utils.DEFAULT_ARGS (float32, CPU, T <= 65536)


@pytest.fixture(scope="module")
def server(llama_model):
    with running_server(llama_model, *SERVER_ARGS, "--enable-metrics") as handle:
        yield handle


def scrape(url: str) -> dict:
    """Sample name -> value, summed over label sets (one model_name here)."""
    resp = requests.get(url + "/metrics", timeout=30)
    assert resp.status_code == 200, resp.text
    values: dict = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def generate(url: str, input_ids: list, max_new_tokens: int, stream: bool = False) -> None:
    body = {"input_ids": input_ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    resp = requests.post(url + "/generate", json=body, timeout=60, stream=stream)
    assert resp.status_code == 200, resp.text
    if stream:
        assert any(line.strip() == b"data: [DONE]" for line in resp.iter_lines())


def documented_names() -> set:
    return set(re.findall(r"`(sglang:[a-z0-9_]+)`", DOC.read_text()))


def test_histogram_buckets_are_cumulative_and_end_with_inf():
    hist = LatencyHistogram((0.1, 1.0))
    for value in (0.05, 0.5, 0.7, 5.0):
        hist.observe(value)
    assert _cumulative_buckets(hist) == [("0.1", 1.0), ("1.0", 3.0), ("+Inf", 4.0)]


def test_gen_throughput_is_rate_since_previous_scrape():
    rate = GenThroughput(start_time=100.0)
    assert rate.update(110.0, 50) == pytest.approx(5.0)
    assert rate.update(112.0, 70) == pytest.approx(10.0)
    assert rate.update(112.0, 70) == 0.0  # two scrapes at one instant


def test_metrics_is_prometheus_text_0_0_4(server):
    resp = requests.get(server.url + "/metrics", timeout=30)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f.type for f in text_string_to_metric_families(resp.text)}
    assert families["sglang:num_running_reqs"] == "gauge"
    assert families["sglang:prompt_tokens"] == "counter"
    assert families["sglang:time_to_first_token_seconds"] == "histogram"


def test_every_documented_metric_is_exposed(server):
    names = documented_names()
    assert len(names) == 17, sorted(names)
    samples = scrape(server.url)
    missing = [n for n in names if n not in samples and n + "_count" not in samples]
    assert not missing, f"documented in docs/metrics.md but not exposed: {missing}"


def test_every_sample_carries_the_model_name(server):
    text = requests.get(server.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL_NAME, sample


def test_idle_gauges(server):
    samples = scrape(server.url)
    assert samples["sglang:num_running_reqs"] == 0
    assert samples["sglang:num_queue_reqs"] == 0
    assert 0 < samples["sglang:max_total_num_tokens"] <= 65536
    assert 0.0 <= samples["sglang:token_usage"] <= 1.0
    assert 0.0 <= samples["sglang:cache_hit_rate"] <= 1.0


def test_counters_move_as_a_request_completes(server):
    before = scrape(server.url)
    generate(server.url, list(range(100, 140)), max_new_tokens=5)
    after = scrape(server.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["sglang:num_requests_total"] == 1
    assert delta["sglang:prompt_tokens_total"] == 40
    assert delta["sglang:generation_tokens_total"] == 5
    assert delta["sglang:prefix_cache_queried_tokens_total"] == 40
    assert delta["sglang:e2e_request_latency_seconds_count"] == 1
    assert delta["sglang:e2e_request_latency_seconds_sum"] > 0
    assert delta["sglang:num_aborted_requests_total"] == 0
    assert after["sglang:gen_throughput"] > 0  # 5 tokens generated since the previous scrape


def test_repeated_prompt_moves_prefix_cache_hit_counters(server):
    prompt = list(range(200, 264))
    generate(server.url, prompt, max_new_tokens=2)
    before = scrape(server.url)
    generate(server.url, prompt, max_new_tokens=2)
    after = scrape(server.url)
    hit = after["sglang:prefix_cache_hit_tokens_total"] - before["sglang:prefix_cache_hit_tokens_total"]
    cached = after["sglang:cached_tokens_total"] - before["sglang:cached_tokens_total"]
    assert 0 < hit <= len(prompt)
    assert cached == hit  # the response's cached_tokens is the scheduler's prefix hit
    assert after["sglang:cache_hit_rate"] > 0


def test_streaming_request_observes_ttft_and_itl(server):
    before = scrape(server.url)
    generate(server.url, list(range(300, 320)), max_new_tokens=8, stream=True)
    after = scrape(server.url)
    assert after["sglang:time_to_first_token_seconds_count"] - before["sglang:time_to_first_token_seconds_count"] == 1
    assert after["sglang:inter_token_latency_seconds_count"] > before["sglang:inter_token_latency_seconds_count"]


def test_metrics_is_404_without_enable_metrics():
    """The real app from create_app, with a state whose args lack --enable-metrics (the 404 path
    reads nothing else, so no model or scheduler is needed)."""
    state = ServerState(server_args=ServerArgs(model_path="unused", enable_metrics=False),
                        tokenizer_manager=None, scheduler_info=None, model_name=MODEL_NAME)

    async def get_metrics() -> tuple:
        async with TestClient(TestServer(create_app(state))) as client:
            resp = await client.get("/metrics")
            return resp.status, await resp.json()

    status, body = asyncio.run(get_metrics())
    assert status == 404
    assert "--enable-metrics" in body["error"]["message"]
    assert body["error"]["type"] == "not_found_error"
