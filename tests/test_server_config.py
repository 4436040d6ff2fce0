"""Defaults and secrets of the launch flags: chunked prefill is on by default (1024 on CPU, 8192 on
CUDA, as --help says), and the API key can come from a file or the environment instead of the
command line (where every local user can read it)."""

from __future__ import annotations

import os

import psutil
import pytest
import requests

from server_utils import start_server, wait_until_ready
from srt.server_args import ServerArgs, effective_chunked_prefill_size, make_parser

KEY = "sk-from-the-environment"


# ---------------------------------------------------------------------- --chunked-prefill-size
@pytest.mark.parametrize("value,device,expected", [
    (None, "cpu", 1024), (None, "cuda", 8192), (None, "cuda:1", 8192),
    (512, "cpu", 512), (-1, "cuda", None), (0, "cpu", None),
])
def test_chunked_prefill_size_defaults_per_device(value, device, expected):
    assert effective_chunked_prefill_size(value, device) == expected


def test_help_states_the_chunked_prefill_defaults():
    text = make_parser().format_help()
    assert "default 8192 on CUDA, 1024 on CPU" in " ".join(text.split())


# ---------------------------------------------------------------------- the API key's sources
def test_api_key_is_read_from_a_file(tmp_path):
    path = tmp_path / "key"
    path.write_text("sk-file\n")
    assert ServerArgs(model_path="unused", api_key_file=str(path)).api_key == "sk-file"


def test_api_key_is_read_from_srt_api_key(monkeypatch):
    monkeypatch.setenv("SRT_API_KEY", "sk-env")
    assert ServerArgs(model_path="unused").api_key == "sk-env"
    assert ServerArgs(model_path="unused", api_key="sk-flag").api_key == "sk-flag"  # the flag wins


def test_api_key_file_problems_are_reported(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        ServerArgs(model_path="unused", api_key_file=str(empty))
    with pytest.raises(ValueError, match="Cannot read --api-key-file"):
        ServerArgs(model_path="unused", api_key_file=str(tmp_path / "missing"))
    key = tmp_path / "key"
    key.write_text("sk-file")
    with pytest.raises(ValueError, match="Both --api-key and --api-key-file"):
        ServerArgs(model_path="unused", api_key="other", api_key_file=str(key))


# ---------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def server(tiny_model_factory):
    """Default flags on a model with an 8k context (so a prompt can exceed the 1024 CPU chunk), the
    API key given through $SRT_API_KEY only."""
    handle = start_server(tiny_model_factory("llama", context=8192), wait_ready=False, env={"SRT_API_KEY": KEY})
    handle.api_key = KEY
    try:
        wait_until_ready(handle)
        yield handle
    finally:
        handle.stop()


def test_default_server_splits_a_long_prompt_into_1024_token_chunks(server):
    assert server.get("/get_server_info").json()["chunked_prefill_size"] == 1024
    prompt = [5 + i % 900 for i in range(5000)]
    out = server.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})
    assert out.status_code == 200, out.text
    logs = server.logs()
    assert logs.count("#new-token: 1024,") >= 4 and "#new-token: 5000," not in logs
    assert "#new-token: 904," in logs  # the tail after four full chunks


def test_api_key_from_the_environment_guards_routes_and_stays_off_command_lines(server):
    assert requests.get(server.url + "/get_model_info", timeout=10).status_code == 401
    assert server.get("/get_model_info").status_code == 200
    front = psutil.Process(server.proc.pid)
    for proc in [front, *front.children(recursive=True)]:
        assert KEY not in " ".join(proc.cmdline()), proc.cmdline()
    assert server.get("/get_server_info").json()["api_key"] == "<redacted>"
    assert os.environ.get("SRT_API_KEY") is None  # the test process itself never had it
