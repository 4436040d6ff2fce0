"""Start-up situations that are not fatal but must be impossible to miss: a --context-length above
the derived one allowed by the environment override, and a model without a chat template. One
server: a copy of the tiny llama without its chat template, started with
SRT_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 --context-length 4096 (derived: 2048)."""

from __future__ import annotations

import pytest

from contract_utils import copy_model
from server_utils import running_server

DERIVED, REQUESTED = 2048, 4096


@pytest.fixture(scope="module")
def server(llama_model, tmp_path_factory):
    path = copy_model(llama_model, tmp_path_factory.mktemp("bare") / "no-template",
                      drop_tokenizer_keys=("chat_template",), remove=("chat_template.jinja",))
    with running_server(path, "--context-length", str(REQUESTED), "--max-total-tokens", "8192",
                        env={"SRT_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}) as handle:
        yield handle


def test_context_length_override_starts_with_a_warning_naming_both_lengths(server):
    assert server.get("/get_server_info").json()["context_length"] == REQUESTED
    card = server.get("/v1/models").json()["data"][0]
    assert card["context_length"] == REQUESTED and card["max_model_len"] == REQUESTED - 6  # max_req_input_len
    assert (f"WARNING srt.configs.model_config: --context-length {REQUESTED} exceeds the derived {DERIVED} "
            f"(max_position_embeddings); allowed by SRT_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN." in server.logs())
    # Positions past the derived length are served (the rotary table covers the requested length).
    resp = server.post("/generate", json={"input_ids": [5] * (DERIVED + 100), "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["prompt_tokens"] == DERIVED + 100


def test_no_chat_template_is_an_info_line_then_chat_requests_get_400_naming_the_flag(server):
    assert "INFO managers.template_manager: No chat template found, defaulting to 'string' content format" \
        in server.logs()
    model = server.get("/v1/models").json()["data"][0]["id"]
    resp = server.post("/v1/chat/completions", json={"model": model, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["message"].startswith("This model has no chat template, so chat messages cannot be turned into a "
                                       "prompt. Start the server with --chat-template")
    assert "/v1/completions" in error["message"] and error["code"] == "chat_template_missing"
    # A plain prompt still works: the server is a base-model server, not a broken one.
    done = server.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] >= 1
