"""The native HTTP API against a real server process: route shapes, SSE framing, batches, logprobs,
admin routes, client disconnects, auth, queue-full, --stream-interval, the watchdogs and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import orjson
import psutil
import pytest
import requests

from server_utils import ServerHandle, running_server, sse_events, start_server

GREEDY = {"temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}  # 0.45 s or more on CPU


def ipc_dirs(pid: int) -> set:
    """The socket directories of a server process (its bound zmq ipc sockets)."""
    socks = psutil.Process(pid).net_connections(kind="unix")
    return {os.path.dirname(c.laddr) for c in socks if isinstance(c.laddr, str) and "srt-ipc-" in c.laddr}


@pytest.fixture(scope="module")
def server(llama_model):
    with running_server(llama_model) as handle:
        yield handle


def generate(server: ServerHandle, **body) -> dict:
    resp = server.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def load(server: ServerHandle) -> dict:
    info = server.get("/get_server_info").json()
    return {**info["load"], "front": info["num_front_end_requests"]}


def wait_idle(server: ServerHandle, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        current = load(server)
        if current["num_running_reqs"] == 0 and current["num_waiting_reqs"] == 0 and current["front"] == 0:
            return current
        assert time.monotonic() < deadline, f"server not idle: {current}"
        time.sleep(0.1)


# ---------------------------------------------------------------------- /generate
def test_generate_single_text_has_sglang_shape(server):
    out = generate(server, text="Hello world", sampling_params={"max_new_tokens": 5, **GREEDY})
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 5
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "total_retractions", "e2e_latency"):
        assert key in meta, key
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5 and meta["prompt_tokens"] > 0
    assert isinstance(meta["cached_tokens"], int) and meta["e2e_latency"] > 0


def test_generate_input_ids_with_rid_matches_text(server, llama_model):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(llama_model)).encode("Hello world")
    by_text = generate(server, text="Hello world", sampling_params={"max_new_tokens": 4, **GREEDY})
    by_ids = generate(server, input_ids=ids, rid="native-rid-1", sampling_params={"max_new_tokens": 4, **GREEDY})
    assert by_ids["meta_info"]["id"] == "native-rid-1"
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)


def test_batch_generate_returns_a_list_in_order(server):
    prompts = ["The licensee may", "Copyright holders", "In no event shall"]
    params = [{"max_new_tokens": n, **GREEDY} for n in (3, 4, 5)]
    batch = generate(server, text=prompts, sampling_params=params)
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, p, out in zip(prompts, params, batch):
        single = generate(server, text=prompt, sampling_params=p)
        assert out["output_ids"] == single["output_ids"]
        assert out["meta_info"]["completion_tokens"] == p["max_new_tokens"]


def test_stream_is_sse_with_cumulative_text_and_done(server):
    params = {"max_new_tokens": 6, **GREEDY}
    final = generate(server, text="Permission is hereby granted", sampling_params=params)
    resp = server.post("/generate", json={"text": "Permission is hereby granted", "sampling_params": params,
                                          "stream": True}, stream=True)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 6  # one update per token at --stream-interval 1
    for prev, nxt in zip(chunks, chunks[1:]):
        assert nxt["text"].startswith(prev["text"])
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    assert chunks[-1]["output_ids"] == final["output_ids"] and chunks[-1]["text"] == final["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_stream_batch_updates_carry_their_index(server):
    resp = server.post("/generate", json={"text": ["One", "Two"], "stream": True,
                                          "sampling_params": {"max_new_tokens": 3, **GREEDY}}, stream=True)
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert set(finals) == {0, 1}
    assert all(len(c["output_ids"]) == 3 for c in finals.values())


def test_output_logprobs_with_text_and_top_logprobs(server):
    out = generate(server, text="Hello", sampling_params={"max_new_tokens": 4, **GREEDY}, return_logprob=True,
                   top_logprobs_num=3, return_text_in_logprobs=True)
    meta = out["meta_info"]
    entries = meta["output_token_logprobs"]
    assert len(entries) == 4
    for (logprob, tid, text), out_id in zip(entries, out["output_ids"]):
        assert logprob <= 0 and tid == out_id and isinstance(text, str)
    assert len(meta["output_top_logprobs"]) == 4
    for top, (logprob, tid, _) in zip(meta["output_top_logprobs"], entries):
        assert len(top) == 3 and top[0][1] == tid  # greedy: the chosen token is the most likely
        assert abs(top[0][0] - logprob) < 1e-4


@pytest.mark.parametrize("start", [0, 3])
def test_prefill_only_returns_input_logprobs_from_start(server, start):
    ids = [5, 17, 230, 41, 99, 7, 300, 12]
    out = generate(server, input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                   logprob_start_len=start)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(ids) - start
    assert entries[0][0] is None
    assert [e[1] for e in entries] == ids[start:]
    assert all(e[0] <= 0 for e in entries[1:])


def test_token_ids_logprob_one_entry_per_output_token(server):
    out = generate(server, text="Hello", sampling_params={"max_new_tokens": 3, **GREEDY}, return_logprob=True,
                   token_ids_logprob=[5, 6])
    rows = out["meta_info"]["output_token_ids_logprobs"]
    assert len(rows) == 3 and all([e[1] for e in row] == [5, 6] for row in rows)
    assert all(e[0] <= 0 for row in rows for e in row)


# ---------------------------------------------------------------------- admin routes
def test_health_routes(server):
    assert server.get("/health").status_code == 200
    assert server.post("/health").status_code == 200
    resp = server.get("/health_generate")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_get_model_info(server, llama_model):
    info = server.get("/get_model_info").json()
    assert info["model_path"] == str(llama_model) and info["tokenizer_path"] == str(llama_model)
    assert info["served_model_name"] == str(llama_model)
    assert info["is_generation"] is True and info["context_length"] == 2048


def test_get_server_info_has_args_limits_version_and_load(server):
    info = server.get("/get_server_info").json()
    assert info["port"] == server.port and info["dtype"] == "float32"
    assert 0 < info["max_total_num_tokens"] <= 65536
    assert info["max_req_input_len"] == min(info["context_length"] - 1, info["max_total_num_tokens"] - 1) - 5
    assert info["max_running_requests"] > 0 and info["context_length"] == 2048
    assert isinstance(info["version"], str) and info["ready"] is True
    assert info["load"]["num_running_reqs"] == 0 and info["load"]["max_total_num_tokens"] == info["max_total_num_tokens"]
    assert info["api_key"] is None


def test_get_server_info_reports_kv_conservation_after_traffic(server):
    generate(server, text=["conservation one", "conservation two"], sampling_params={**GREEDY, "max_new_tokens": 6})
    load = server.get("/get_server_info").json()["load"]
    mem = load["memory"]
    assert mem["available_size"] + mem["evictable_size"] + mem["protected_size"] == load["max_total_num_tokens"]
    assert mem["evictable_size"] > 0  # the two prompts stayed in the radix cache
    assert mem["protected_size"] == 0 and mem["num_free_req_slots"] == mem["num_req_slots"] > 0


def test_flush_cache_refused_while_running_then_abort_by_rid(server):
    body = {"text": "A long story", "rid": "flush-test-abc", "stream": True, "sampling_params": LONG}
    with server.post("/generate", json=body, stream=True) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith(b"data: ")
        refused = server.post("/flush_cache")
        assert refused.status_code == 400
        assert "Cache not flushed" in refused.json()["error"]["message"]
        assert server.post("/abort_request", json={"rid": "flush-test-abc"}).status_code == 200  # exact rid
        rest = [line[6:] for line in lines if line]
    assert rest[-1] == b"[DONE]"
    last = orjson.loads(rest[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
    wait_idle(server)
    flushed = server.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.json()["success"] is True


def test_abort_all_ends_a_non_stream_request(server):
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        out=generate(server, text="Abort me", sampling_params=LONG)))
    worker.start()
    deadline = time.monotonic() + 10
    while load(server)["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.post("/abort_request", json={"abort_all": True}).json() == {"success": True}
    worker.join(20)
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    wait_idle(server)


# ---------------------------------------------------------------------- disconnects
def test_client_disconnect_mid_stream_aborts_the_request(server):
    aborts_before = load(server)["counters"]["num_aborts"]
    resp = server.post("/generate", json={"text": "Disconnect me", "stream": True, "sampling_params": LONG},
                       stream=True)
    seen = 0
    for line in resp.iter_lines():
        seen += bool(line)
        if seen == 2:
            break
    resp.close()  # the client goes away mid-stream
    after = wait_idle(server)
    assert after["counters"]["num_aborts"] == aborts_before + 1
    assert after["token_usage"] == 0.0  # every KV slot is back: free or evictable in the tree
    assert server.get("/health_generate").status_code == 200  # conservation held, scheduler alive


def test_client_disconnect_mid_request_aborts_the_request(server):
    aborts_before = load(server)["counters"]["num_aborts"]
    with pytest.raises(requests.exceptions.ReadTimeout):
        # 1,500 tokens take 0.45 s on a 2-core Zen 5 EPYC: the client leaves well before the end.
        server.post("/generate", json={"text": "Time out", "sampling_params": LONG}, timeout=(5, 0.1))
    after = wait_idle(server)
    assert after["counters"]["num_aborts"] == aborts_before + 1
    assert server.get("/health_generate").status_code == 200


# ---------------------------------------------------------------------- a limited server
@pytest.fixture(scope="module")
def limited(llama_model):
    """--api-key, one running and one queued request at most, updates every 3 tokens, a short watchdog."""
    with running_server(llama_model, "--api-key", "sk-test", "--max-running-requests", "1",
                        "--max-queued-requests", "1", "--stream-interval", "3", "--watchdog-timeout", "5") as handle:
        yield handle


@pytest.mark.parametrize("headers,status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"x-api-key": "sk-tes"}, 401),
    ({"Authorization": "Bearer sk-test"}, 200),
    ({"authorization": "bearer sk-test"}, 200),
    ({"x-api-key": "sk-test"}, 200),
])
def test_api_key_guards_routes(limited, headers, status):
    for method, path, body in (("GET", "/get_model_info", None), ("POST", "/generate",
                                                                 {"text": "Hi", "sampling_params": {"max_new_tokens": 1}})):
        resp = requests.request(method, limited.url + path, headers=headers, json=body, timeout=30)
        assert resp.status_code == status, (path, resp.text)
        if status == 401:
            assert resp.json()["error"]["type"] == "authentication_error"
            assert "API key" in resp.json()["error"]["message"]


def test_health_needs_no_api_key_but_everything_else_does(limited, server):
    assert requests.get(limited.url + "/health", timeout=10).status_code == 200
    assert requests.get(limited.url + "/health_generate", timeout=10).status_code == 401
    assert requests.get(limited.url + "/no_such_route", timeout=10).status_code == 401
    assert requests.get(server.url + "/get_model_info", timeout=10).status_code == 200  # no key configured
    assert limited.get("/get_server_info").json()["api_key"] == "<redacted>"


def test_queue_full_is_503(limited):
    running = limited.post("/generate", json={"text": "Runs", "stream": True, "sampling_params": LONG}, stream=True)
    lines = running.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: ")
    waiting = {}
    worker = threading.Thread(target=lambda: waiting.update(
        resp=limited.post("/generate", json={"text": "Waits", "sampling_params": LONG})))
    worker.start()
    deadline = time.monotonic() + 10
    while limited.get("/get_server_info").json()["load"]["num_waiting_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused = limited.post("/generate", json={"text": "Refused", "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == ("The request queue is full. 1 requests are waiting "
                                                  "(--max-queued-requests=1); retry later.")
    limited.post("/abort_request", json={"abort_all": True})
    worker.join(30)
    running.close()
    assert waiting["resp"].status_code == 200
    assert waiting["resp"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert limited.get("/health_generate").status_code == 200


def test_stream_interval_sends_every_n_tokens_and_the_last(limited):
    resp = limited.post("/generate", json={"text": "Count", "stream": True,
                                           "sampling_params": {"max_new_tokens": 10, **GREEDY}}, stream=True)
    chunks = [json.loads(e) for e in sse_events(resp)[:-1]]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [3, 6, 9, 10]


def test_stuck_scheduler_trips_the_watchdog(limited):
    """Last test on this server: a stopped scheduler looks like a forward that never returns."""
    pid = limited.get("/get_server_info").json()["pids"]["Scheduler"]
    os.kill(pid, signal.SIGSTOP)
    try:
        resp = limited.post("/generate", json={"text": "Stuck", "sampling_params": {"max_new_tokens": 2}},
                            timeout=30)
        assert resp.status_code == 503 and "watchdog" in resp.json()["error"]["message"]
        rc = limited.proc.wait(15)
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGCONT)
    assert rc != 0
    last = limited.logs().strip().splitlines()[-1]
    assert "Scheduler watchdog" in last and "--watchdog-timeout=5" in last
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# ---------------------------------------------------------------------- lifecycle
def test_killed_scheduler_takes_the_server_down_with_its_cause(llama_model):
    handle = start_server(llama_model, "--skip-server-warmup")
    try:
        pid = handle.get("/get_server_info").json()["pids"]["Scheduler"]
        os.kill(pid, signal.SIGKILL)
        assert handle.proc.wait(15) != 0
        last = handle.logs().strip().splitlines()[-1]
        assert "Scheduler process" in last and "SIGKILL" in last
    finally:
        handle.stop(5)


def test_ctrl_c_stops_children_and_removes_the_socket_dir(server):
    """Last test of the module: stops the shared server."""
    pids = server.get("/get_server_info").json()["pids"]
    dirs = ipc_dirs(server.proc.pid)
    assert len(dirs) == 1 and os.path.isdir(next(iter(dirs)))
    assert server.stop() == 0
    assert "Shutting down" in server.logs()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids.values())
    assert not any(os.path.exists(d) for d in dirs)
