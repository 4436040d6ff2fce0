"""Typed messages between the runtime's processes (tokenizer manager, scheduler, detokenizer).

A message is two zmq frames: the `io_struct` class name and the object as msgpack (msgspec).
Decoding builds only the dataclasses of `managers.io_struct`, field by field with their types
checked, so a peer that can reach the socket can at worst send a malformed message, never run
code (pickle would); msgpack is also several times cheaper than pickle per step.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Dict, List

import msgspec

from managers import io_struct

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: Dict[bytes, msgspec.msgpack.Decoder] = {}
_FIELDS: Dict[bytes, frozenset] = {}
_SHALLOW = msgspec.msgpack.Decoder(Dict[str, msgspec.Raw])  # top-level keys only; values stay undecoded


class IPCDecodeError(ValueError):
    """A frame that is not one of our messages (unknown type or fields of the wrong type)."""


def _decoders() -> Dict[bytes, msgspec.msgpack.Decoder]:
    if not _DECODERS:
        for name, cls in vars(io_struct).items():
            if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == io_struct.__name__:
                _DECODERS[name.encode()] = msgspec.msgpack.Decoder(cls)
                _FIELDS[name.encode()] = frozenset(f.name for f in dataclasses.fields(cls))
    return _DECODERS


def dumps(msg: Any) -> List[bytes]:
    name = type(msg).__name__.encode()
    if name not in _decoders():
        raise TypeError(f"{type(msg).__name__} is not an io_struct message and cannot cross a process boundary")
    return [name, _ENCODER.encode(msg)]


def loads(frames: List[bytes]) -> Any:
    if len(frames) != 2:
        raise IPCDecodeError(f"expected 2 frames (type, payload), got {len(frames)}")
    decoder = _decoders().get(bytes(frames[0]))
    if decoder is None:
        raise IPCDecodeError(f"unknown message type {bytes(frames[0])[:64]!r}")
    try:
        unknown = set(_SHALLOW.decode(frames[1])) - _FIELDS[bytes(frames[0])]
        if unknown:  # msgspec would drop them silently and fill defaults: refuse instead
            raise IPCDecodeError(f"malformed {bytes(frames[0]).decode()} message: unknown fields {sorted(unknown)}")
        # The cyclic GC stays off while a message is built: decoding the 150k small lists of one
        # batch's top logprobs set off full collections that took 0.15 s of the event loop (7 ms
        # without); a decoded message holds no cycles (docs/architecture.md, "Hostile input").
        enabled = gc.isenabled()
        gc.disable()
        try:
            return decoder.decode(frames[1])
        finally:
            if enabled:
                gc.enable()
    except msgspec.DecodeError as exc:
        raise IPCDecodeError(f"malformed {bytes(frames[0]).decode()} message: {exc}") from exc


def send(sock: Any, msg: Any, flags: int = 0) -> None:
    sock.send_multipart(dumps(msg), flags=flags)


def recv(sock: Any, flags: int = 0) -> Any:
    return loads(sock.recv_multipart(flags=flags))


async def recv_async(sock: Any) -> Any:
    return loads(await sock.recv_multipart())
