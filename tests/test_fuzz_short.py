"""The CI version of scripts/fuzz_server.py: a few hundred generated and mutated bodies across
every route; every answer a JSON 4xx or a valid 200 in time, and the server healthy after."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from server_utils import running_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import fuzz_server  # noqa: E402
from fuzz_server import FUZZ_SERVER_ARGS, FuzzRun, check_healthy_after, format_table, fuzz  # noqa: E402


def test_short_fuzz_gets_only_json_4xx_or_valid_200(llama_model):
    with running_server(llama_model, *FUZZ_SERVER_ARGS) as server:
        run = FuzzRun(server.url, deadline_s=60)
        fuzz(run, num_examples=400, seed=11)
        problems = check_healthy_after(server.url)
        assert server.alive()
    table = format_table(run)
    assert problems == [], problems
    assert run.sent >= 400, table
    posts = {route: counts for route, counts in run.statuses.items() if route.startswith("/")}
    assert sum(c[400] for c in posts.values()) > 100, table  # most mutated bodies are refused ...
    assert sum(c[200] for c in posts.values()) > 5, table  # ... and some are valid and served
    assert not any(code >= 500 for counts in run.statuses.values() for code in counts), table


def _fake(status: int, body: bytes, ctype: str = "application/json"):
    raw = SimpleNamespace(read=lambda decode_content=True: body)
    return SimpleNamespace(status_code=status, content=body, raw=raw, headers={"Content-Type": ctype})


@pytest.mark.parametrize("status,body,ctype,needle", [
    (500, b'{"error": {"message": "boom"}}', "application/json", "-> 500"),
    (400, b"<html>bad</html>", "text/html", "Expecting value"),
    (200, b"data: {}\n\n", "text/event-stream", "stream without [DONE]"),
])
def test_fuzz_checks_catch_5xx_non_json_errors_and_cut_streams(monkeypatch, status, body, ctype, needle):
    monkeypatch.setattr(fuzz_server.requests, "request", lambda *a, **k: _fake(status, body, ctype))
    with pytest.raises(Exception, match=needle.replace("[", r"\[").replace("]", r"\]")):
        FuzzRun("http://fake", deadline_s=5).check("POST", "/generate", {"text": "a"})
