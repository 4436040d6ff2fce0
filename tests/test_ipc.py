"""The typed IPC encoding (managers/ipc.py): every io_struct message round-trips, and a frame
that is not one of our messages (a pickle, an unknown type, wrong field types) is refused."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from managers import io_struct, ipc
from srt.sampling.sampling_params import SamplingParams


def sample_messages():
    sp = SamplingParams(max_new_tokens=5, stop=["\n\n"], logit_bias={3: -1.5}, regex="[a-z]+")
    sp.stop_str_max_len = 4
    yield io_struct.TokenizedGenerateReqInput(rid="r1", input_ids=[1, 2, 3], sampling_params=sp, input_text="hi",
                                              return_logprob=True, logprob_start_len=0, token_ids_logprob=[7],
                                              extra_key=("k", "salt"))
    yield io_struct.TokenizedGenerateReqInput(rid="r2", input_ids=[4], sampling_params=SamplingParams(),
                                              extra_key="k")
    yield io_struct.AbortReq(rid="r1")
    yield io_struct.FlushCacheReqOutput(success=False, message="busy")
    yield io_struct.GetLoadReqOutput(num_running_reqs=1, num_waiting_reqs=2, token_usage=0.5,
                                     max_total_num_tokens=100, counters={"a": 1.0}, replicas=[{"x": 1}])
    yield io_struct.BatchTokenIDOut(rids=["a"], output_ids=[[1, 2]], finished_reasons=[{"type": "length", "length": 2}],
                                    meta_info=[{"prompt_tokens": 3, "output_token_logprobs": [[-0.5, 1, None]]}],
                                    decode_params=[io_struct.DecodeParams(stop=["x"])], input_tail_ids=[[9]])
    yield io_struct.BatchStrOut(rids=["a"], texts=["hé"], output_ids=[[1]], finished_reasons=[None])
    yield io_struct.SchedulerReady(ok=True, max_total_num_tokens=10, kv_budget={"t": 1})


@pytest.mark.parametrize("msg", list(sample_messages()), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    back = ipc.loads(ipc.dumps(msg))
    assert type(back) is type(msg)
    assert dataclasses.asdict(back) == dataclasses.asdict(msg)
    if isinstance(msg, io_struct.TokenizedGenerateReqInput):
        assert back.sampling_params.stop_str_max_len == msg.sampling_params.stop_str_max_len
        assert back.extra_key == msg.extra_key and type(back.extra_key) is type(msg.extra_key)


def test_all_io_struct_types_are_registered():
    names = {n for n, c in vars(io_struct).items()
             if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == io_struct.__name__}
    assert {n.encode() for n in names} == set(ipc._decoders())


class Evil:
    def __reduce__(self):
        return (exec, ("import os; os.environ['PWNED'] = '1'",))


def test_a_pickle_or_unknown_or_malformed_frame_is_refused_without_running_code(monkeypatch):
    monkeypatch.delenv("PWNED", raising=False)
    with pytest.raises(ipc.IPCDecodeError):
        ipc.loads([pickle.dumps(Evil())])
    with pytest.raises(ipc.IPCDecodeError, match="unknown message type"):
        ipc.loads([b"Evil", pickle.dumps(Evil())])
    with pytest.raises(ipc.IPCDecodeError, match="malformed AbortReq"):
        ipc.loads([b"AbortReq", pickle.dumps(Evil())])
    frames = ipc.dumps(io_struct.AbortReq(rid="x"))
    bad = ipc.dumps(io_struct.BatchStrOut(rids=["a"], texts=["t"], output_ids=[[1]], finished_reasons=[None]))
    with pytest.raises(ipc.IPCDecodeError):
        ipc.loads([frames[0], bad[1]])
    import os
    assert "PWNED" not in os.environ
    with pytest.raises(TypeError, match="not an io_struct message"):
        ipc.dumps({"rid": "x"})


def test_decoding_runs_with_the_collector_off_and_restores_its_state(monkeypatch):
    """A big message decodes with the cyclic GC off (its full collections cost the event loop
    20x the decode), and the collector's state is the caller's again afterwards, errors included."""
    import gc

    seen = []
    real = ipc._decoders()[b"BatchStrOut"]

    class Spy:
        def decode(self, payload):
            seen.append(gc.isenabled())
            return real.decode(payload)

    monkeypatch.setitem(ipc._DECODERS, b"BatchStrOut", Spy())
    msg = io_struct.BatchStrOut(rids=["r"], texts=["x"], output_ids=[[1, 2]], finished_reasons=[None],
                                meta_info=[{"output_top_logprobs": [[[0.5, 1]] * 20] * 300}])
    frames = ipc.dumps(msg)
    assert gc.isenabled()
    assert ipc.loads(frames) == msg and seen == [False] and gc.isenabled()
    gc.disable()
    try:
        assert ipc.loads(frames) == msg and not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ipc.IPCDecodeError):
        ipc.loads([b"BatchStrOut", frames[1][:-3]])
    assert gc.isenabled()
