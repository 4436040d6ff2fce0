"""Detokenizer: incremental ids in, incremental text out, UTF-8 safety, stop strings, per-rid
state (freed at the finish), the process loop."""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace
from typing import List, Optional, Sequence

import pytest
import zmq
from transformers import AutoTokenizer

from managers import ipc

from managers.detokenizer_manager import DetokenizerManager, run_detokenizer_process, stop_safe_len
from managers.io_struct import (
    BatchStrOut,
    BatchTokenIDOut,
    DecodeParams,
    FlushCacheReqOutput,
    GetLoadReqOutput,
)

MULTIBYTE_TEXT = "Hello 你好世界 😀 café naïve señor 🎉!"
LENGTH = {"type": "length", "length": 1}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tokenizer(request):
    return AutoTokenizer.from_pretrained(request.getfixturevalue(f"{request.param}_model"))


@pytest.fixture(scope="module")
def llama_tokenizer(llama_model):
    return AutoTokenizer.from_pretrained(llama_model)


def encode(tokenizer, *pieces: str) -> List[int]:
    """Ids whose decode is exactly "".join(pieces) (byte-level BPE), with a token boundary between pieces."""
    return [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False)]


def token_out(rids: Sequence[str], output_ids, finished=None, params=None, tails=None,
              offsets=None) -> BatchTokenIDOut:
    n = len(rids)
    return BatchTokenIDOut(
        rids=list(rids),
        output_ids=[list(ids) for ids in output_ids],
        finished_reasons=list(finished or [None] * n),
        meta_info=[{"id": rid} for rid in rids],
        decode_params=list(params or [DecodeParams()] * n),
        input_tail_ids=[list(t) for t in (tails or [[]] * n)],
        output_offsets=list(offsets or [0] * n),
    )


def stream(manager: DetokenizerManager, rid: str, ids: List[int], finish: Optional[dict] = LENGTH,
           params: Optional[DecodeParams] = None, tail: Sequence[int] = ()) -> List[str]:
    """Feed `ids` one new token per message, as the scheduler does (the prompt tail with the first),
    finishing with `finish` on the last one; returns the client's text after each update."""
    texts, text = [], ""
    for n in range(1, len(ids) + 1):
        last = finish if n == len(ids) else None
        msg = token_out([rid], [ids[n - 1:n]], [last], [params or DecodeParams()], [tail if n == 1 else []], [n - 1])
        out = manager.handle_batch_token_id_out(msg)
        assert out.text_offsets == [len(text)] and out.output_offsets == [n - 1]
        text += out.texts[0]
        texts.append(text)
    return texts


def test_multibyte_characters_split_across_tokens_never_stream_a_replacement_char(tokenizer):
    ids = encode(tokenizer, MULTIBYTE_TEXT)
    split_chars = [c for c in MULTIBYTE_TEXT if ord(c) > 127 and len(encode(tokenizer, c)) > 1]
    assert len(split_chars) >= 4, "the tiny tokenizer must split multi-byte characters across tokens"
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)

    texts = stream(DetokenizerManager(tokenizer), "r", ids, tail=encode(tokenizer, "User: hi")[-5:])

    assert all("\ufffd" not in text for text in texts)
    assert texts[-1] == tokenizer.decode(ids) == MULTIBYTE_TEXT


def test_cumulative_text_never_shrinks(tokenizer):
    ids = encode(tokenizer, MULTIBYTE_TEXT, " AB", "C", " ABX", " end")
    params = DecodeParams(stop=["ABCD", "😀 ca"])

    texts = stream(DetokenizerManager(tokenizer), "r", ids, params=params)

    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before), (before, after)
    assert texts[-1] == tokenizer.decode(ids)


def test_prompt_tail_is_context_only(llama_tokenizer):
    tail = encode(llama_tokenizer, "Question: why?")[-5:]
    ids = encode(llama_tokenizer, " Because", " 你好")

    texts = stream(DetokenizerManager(llama_tokenizer), "r", ids, tail=tail)

    assert texts[-1] == " Because 你好"


def test_prompt_tail_ending_inside_a_character_does_not_shift_the_output(llama_tokenizer):
    char_ids = encode(llama_tokenizer, "你")
    tail = encode(llama_tokenizer, "Say")[-3:] + char_ids[:1]
    ids = char_ids[1:] + encode(llama_tokenizer, " ok")

    texts = stream(DetokenizerManager(llama_tokenizer), "r", ids, tail=tail)

    assert texts[-1] == llama_tokenizer.decode(ids)
    assert texts[-1].endswith(" ok")


def test_each_step_decodes_only_a_short_tail(llama_tokenizer):
    lengths = []
    original = llama_tokenizer.batch_decode

    def recording_batch_decode(seqs, **kwargs):
        lengths.extend(len(seq) for seq in seqs)
        return original(seqs, **kwargs)

    ids = encode(llama_tokenizer, " ".join(["word"] * 40) + " 你好")
    assert len(ids) > 40
    manager = DetokenizerManager(llama_tokenizer)
    manager.decoder._batch_decode = recording_batch_decode

    texts = stream(manager, "r", ids, tail=encode(llama_tokenizer, "Prompt: go")[-5:])

    assert max(lengths) <= 10
    assert texts[-1] == llama_tokenizer.decode(ids)


def test_stop_string_split_across_tokens_is_trimmed_with_everything_after_it(llama_tokenizer):
    ids = encode(llama_tokenizer, "Hi", " S", "TOP more")
    finish = {"type": "stop", "matched": "STO"}

    texts = stream(DetokenizerManager(llama_tokenizer), "r", ids, finish, DecodeParams(stop=["STO"]))

    assert texts[-1] == "Hi "


def test_no_stop_trim_keeps_the_stop_string_and_holds_nothing_back(llama_tokenizer):
    ids = encode(llama_tokenizer, "Hi", " S", "TOP")
    finish = {"type": "stop", "matched": "STOP"}
    n_until_s = len(encode(llama_tokenizer, "Hi", " S"))
    params = DecodeParams(stop=["STOP"], no_stop_trim=True)

    texts = stream(DetokenizerManager(llama_tokenizer), "r", ids, finish, params)

    assert texts[n_until_s - 1] == "Hi S"
    assert texts[-1] == "Hi STOP"


def test_partial_stop_string_is_held_back_then_released_when_it_fails(llama_tokenizer):
    pieces = ["Say", " A", "B", "X", " done"]
    ids = encode(llama_tokenizer, *pieces)
    n_until_b = len(encode(llama_tokenizer, *pieces[:3]))

    texts = stream(DetokenizerManager(llama_tokenizer), "r", ids, params=DecodeParams(stop=["ABCD"]))

    assert texts[n_until_b - 1] == "Say "
    assert texts[n_until_b] == "Say ABX"
    assert texts[-1] == "Say ABX done"


def test_full_stop_string_is_never_streamed_before_the_finish_arrives(llama_tokenizer):
    ids = encode(llama_tokenizer, "Hi", " STOP", " more", " text")

    texts = stream(DetokenizerManager(llama_tokenizer), "r", ids, finish=None, params=DecodeParams(stop=["STOP"]))

    assert texts[-1] == "Hi "
    assert all("ST" not in text for text in texts)


@pytest.mark.parametrize("skip, expected", [(True, "hi"), (False, "hi<|im_end|>")])
def test_skip_special_tokens_decides_whether_special_tokens_show(llama_tokenizer, skip, expected):
    ids = encode(llama_tokenizer, "hi") + [llama_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    finish = {"type": "stop", "matched": ids[-1]}

    texts = stream(DetokenizerManager(llama_tokenizer), "r", ids, finish, DecodeParams(skip_special_tokens=skip))

    assert texts[-1] == expected


def test_request_cut_inside_a_character_ends_like_a_one_shot_decode(llama_tokenizer):
    ids = encode(llama_tokenizer, "ok ", "😀")[:-1]

    texts = stream(DetokenizerManager(llama_tokenizer), "r", ids)

    assert all("\ufffd" not in text for text in texts[:-1])
    assert texts[-1] == llama_tokenizer.decode(ids)


def test_interleaved_rids_keep_separate_state_and_free_it_on_finish(llama_tokenizer):
    manager = DetokenizerManager(llama_tokenizer)
    a, b = encode(llama_tokenizer, "你好 alpha"), encode(llama_tokenizer, "beta 😀 gamma")
    text = {"a": "", "b": ""}
    for n in range(1, max(len(a), len(b)) + 1):
        rids = [rid for rid, ids in (("a", a), ("b", b)) if n <= len(ids)]
        pieces = [(a if rid == "a" else b)[n - 1:n] for rid in rids]
        finished = [LENGTH if n == len(a if rid == "a" else b) else None for rid in rids]
        msg = manager.handle_batch_token_id_out(token_out(rids[::-1], pieces[::-1], finished[::-1],
                                                          offsets=[n - 1] * len(rids)))
        assert msg.rids == rids[::-1] and msg.output_ids == pieces[::-1]
        for rid, offset, piece in zip(msg.rids, msg.text_offsets, msg.texts):
            assert offset == len(text[rid])
            text[rid] += piece
        assert len(manager.decode_status) == sum(f is None for f in finished)

    assert text == {"a": "你好 alpha", "b": "beta 😀 gamma"}
    assert not manager.decode_status


def test_cumulative_updates_are_accepted_and_ids_already_received_are_skipped(llama_tokenizer):
    manager = DetokenizerManager(llama_tokenizer)
    ids = encode(llama_tokenizer, "one two 你好 three")
    text = ""
    for n in range(1, len(ids) + 1):  # every update carries all ids from offset 0
        out = manager.handle_batch_token_id_out(token_out(["r"], [ids[:n]], [LENGTH if n == len(ids) else None]))
        assert out.text_offsets == [len(text)]
        text += out.texts[0]
    assert text == "one two 你好 three" and not manager.decode_status


def test_an_abort_finish_frees_the_state_and_sends_the_held_text(llama_tokenizer):
    manager = DetokenizerManager(llama_tokenizer)
    ids = encode(llama_tokenizer, "Hi", " AB")
    first = manager.handle_batch_token_id_out(token_out(["r"], [ids], params=[DecodeParams(stop=["ABC"])]))
    assert first.texts == ["Hi "] and list(manager.decode_status) == ["r"]
    aborted = {"type": "abort", "message": "Aborted by request.", "status_code": 499}
    out = manager.handle_batch_token_id_out(token_out(["r"], [[]], [aborted], [DecodeParams(stop=["ABC"])],
                                                      offsets=[len(ids)]))
    assert out.texts == ["AB"] and out.text_offsets == [3]
    assert not manager.decode_status


def test_a_gap_in_the_ids_is_reported(llama_tokenizer, caplog):
    manager = DetokenizerManager(llama_tokenizer)
    ids = encode(llama_tokenizer, "one two three")
    manager.handle_batch_token_id_out(token_out(["r"], [ids[:1]]))
    manager.handle_batch_token_id_out(token_out(["r"], [ids[2:]], [LENGTH], offsets=[2]))
    assert "sent output ids from 2 but only 1 arrived before" in caplog.text


def test_other_messages_pass_through_unchanged(llama_tokenizer):
    manager = DetokenizerManager(llama_tokenizer)
    for msg in (FlushCacheReqOutput(success=True), GetLoadReqOutput(1, 2, 0.5, 100)):
        assert manager.handle(msg) is msg
    out = manager.handle(token_out(["r"], [encode(llama_tokenizer, "hi")], [LENGTH]))
    assert isinstance(out, BatchStrOut) and out.texts == ["hi"] and out.meta_info == [{"id": "r"}]


@pytest.mark.parametrize("text, start, expected", [
    ("abc", 0, 3),
    ("xAB", 0, 1),       # "AB" may become "ABCD"
    ("xABCDy", 0, 1),    # a full stop: nothing from it on
    ("xABX", 1, 4),      # the prefix failed
    ("AB", 2, 2),        # never before what was sent
])
def test_stop_safe_len(text, start, expected):
    assert stop_safe_len(text, ["ABCD"], start) == expected


def _recv(socket: zmq.Socket, timeout_ms: int):
    assert socket.poll(timeout_ms), "no reply from the detokenizer process"
    return ipc.recv(socket)


def test_detokenizer_process_round_trip_and_sigterm(llama_model, llama_tokenizer, tmp_path):
    server_args = SimpleNamespace(tokenizer_path=str(llama_model), trust_remote_code=False)
    port_args = SimpleNamespace(detokenizer_ipc_name=f"ipc://{tmp_path}/detokenizer",
                                tokenizer_ipc_name=f"ipc://{tmp_path}/tokenizer")
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_detokenizer_process, args=(server_args, port_args, writer), daemon=True)
    zctx = zmq.Context()
    try:
        from_detok = zctx.socket(zmq.PULL)
        from_detok.bind(port_args.tokenizer_ipc_name)
        proc.start()
        writer.close()
        assert reader.poll(30), "the detokenizer did not report ready"
        assert reader.recv() == {"ok": True}
        to_detok = zctx.socket(zmq.PUSH)
        to_detok.connect(port_args.detokenizer_ipc_name)
        to_detok.send_pyobj(FlushCacheReqOutput(success=True))  # a pickle: dropped, never unpickled
        ipc.send(to_detok, token_out(["r"], [encode(llama_tokenizer, "hi 你好")], [LENGTH]))
        ipc.send(to_detok, FlushCacheReqOutput(success=True))

        out = _recv(from_detok, 5000)
        assert isinstance(out, BatchStrOut) and out.rids == ["r"] and out.texts == ["hi 你好"]
        assert _recv(from_detok, 5000) == FlushCacheReqOutput(success=True)

        proc.terminate()
        proc.join(5)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(1)
        zctx.destroy(linger=0)


def test_detokenizer_process_reports_start_up_errors(tmp_path):
    missing = tmp_path / "no-such-tokenizer"
    server_args = SimpleNamespace(tokenizer_path=str(missing), trust_remote_code=False)
    port_args = SimpleNamespace(detokenizer_ipc_name=f"ipc://{tmp_path}/d", tokenizer_ipc_name=f"ipc://{tmp_path}/t")
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_detokenizer_process, args=(server_args, port_args, writer), daemon=True)
    proc.start()
    writer.close()
    try:
        assert reader.poll(30), "the detokenizer did not report its start-up error"
        msg = reader.recv()
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(1)
    assert msg["ok"] is False and str(missing) in msg["error"]
    assert proc.exitcode == 1
