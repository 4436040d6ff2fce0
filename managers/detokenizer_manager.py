"""Detokenizer process: turns the scheduler's incremental output ids into incremental text.

Keeps one `DecodeStatus` per live rid, decodes only the new tail of each request (with a few
tokens of left context), never emits an incomplete UTF-8 character, trims matched stop strings
and holds back text that may become one; each update carries only the text not sent before.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

from managers import ipc
from managers.io_struct import BatchStrOut, BatchTokenIDOut, DecodeParams
from managers.stop_text import REPLACEMENT_CHAR

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 200  # how often the loop checks for SIGTERM and a dead parent while idle
_DEFAULT_PARAMS = DecodeParams()


@dataclass
class DecodeStatus:
    """Incremental state of one rid. `decode_ids` are its prompt tail (`tail_len` ids, left
    context only), then every output id received so far.

    decode_ids[surr_offset:read_offset]: already in `decoded_text`, the left context of the next decode.
    decode_ids[read_offset:]: not yet in `decoded_text` (they may end inside a UTF-8 character).
    decoded_text[:sent_offset]: what the updates so far carried; it never moves backwards.
    decoded_text[:stop_free_len]: text of outputs before `min_new_tokens - 1`; a stop string that
    ends inside it never stops the request, so it is not held back.
    """

    decode_ids: List[int]
    tail_len: int
    decoded_text: str = ""
    surr_offset: int = 0
    read_offset: int = 0
    sent_offset: int = 0
    stop_free_len: int = 0

    @property
    def num_output_ids(self) -> int:
        return len(self.decode_ids) - self.tail_len

    def add_piece(self, ids: Sequence[int], offset: int, rid: Hashable) -> None:
        """Append the output ids that start at `offset`; ids already received are skipped, so a
        cumulative update (offset 0) is accepted too. A gap means an update was lost."""
        have = self.num_output_ids
        if offset > have:
            logger.error("Detokenizer: rid %r sent output ids from %d but only %d arrived before; "
                         "its text misses the ids in between.", rid, offset, have)
            offset = have
        self.decode_ids.extend(ids[have - offset:])


class TextDecoder:
    """Batch decode with the keyword arguments the tokenizer accepts (probed once)."""

    _KWARGS = ("skip_special_tokens", "spaces_between_special_tokens")

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.accepted = self._probe_kwargs()
        self._batch_decode = getattr(tokenizer, "batch_decode", None)

    def _probe_kwargs(self) -> Tuple[str, ...]:
        for n in range(len(self._KWARGS), -1, -1):
            names = self._KWARGS[:n]
            try:
                self.tokenizer.decode([], **{name: True for name in names})
                return names
            except TypeError:
                continue
        return ()

    def decode(self, seqs: List[List[int]], params: DecodeParams) -> List[str]:
        kwargs = {name: getattr(params, name) for name in self.accepted}
        if self._batch_decode is not None:
            return list(self._batch_decode(seqs, **kwargs))
        return [self.tokenizer.decode(seq, **kwargs) for seq in seqs]


def stop_safe_len(text: str, stops: Sequence[str], start: int, stop_free_len: int = 0) -> int:
    """How much of `text` may be sent while the request runs: up to the first full stop string
    ending after `start` (and after `stop_free_len`, see `DecodeStatus`), else all but the
    longest suffix that is a proper prefix of a stop string."""
    stops = [s for s in stops if s]
    if not stops:
        return len(text)
    max_len = max(len(s) for s in stops)
    after = max(start, stop_free_len)
    found = [pos for pos in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if pos != -1]
    if found:
        return min(found)
    for k in range(min(max_len - 1, len(text) - start), 0, -1):
        suffix = text[-k:]
        if any(len(s) > k and s.startswith(suffix) for s in stops):
            return len(text) - k
    return len(text)


class DetokenizerManager:
    """`BatchTokenIDOut` -> `BatchStrOut`; every other message passes through unchanged.

    Holds one `DecodeStatus` per live rid, created by its first update and dropped by its finish
    (the scheduler sends one for every request it reports: finished, aborted or refused).
    """

    def __init__(self, tokenizer: Any):
        self.decoder = TextDecoder(tokenizer)
        self.decode_status: Dict[Hashable, DecodeStatus] = {}

    def handle(self, msg: Any) -> Any:
        """Dispatch of the process loop: what to send to the tokenizer manager for `msg`."""
        if isinstance(msg, BatchTokenIDOut):
            return self.handle_batch_token_id_out(msg)
        return msg

    def handle_batch_token_id_out(self, msg: BatchTokenIDOut) -> BatchStrOut:
        n = len(msg.rids)
        params = [_item(msg.decode_params, i, _DEFAULT_PARAMS) for i in range(n)]
        keys = [self._key(msg, i) for i in range(n)]
        states = []
        for i, key in enumerate(keys):
            state = self._status(key, _item(msg.input_tail_ids, i, []))
            state.add_piece(msg.output_ids[i], _item(msg.output_offsets, i, 0), key)
            states.append(state)
        surr_texts, read_texts = self._decode_windows(states, params)
        texts, text_offsets = [], []
        for i, state in enumerate(states):
            finished = msg.finished_reasons[i]
            self._advance(state, surr_texts[i], read_texts[i], params[i], finished is not None)
            start = state.sent_offset
            end = self._visible_len(state, params[i], finished, _item(msg.stop_str_from_end, i, None))
            texts.append(state.decoded_text[start:end])
            text_offsets.append(start)
            if finished is not None:
                self.decode_status.pop(keys[i], None)
        return BatchStrOut(
            rids=list(msg.rids),
            texts=texts,
            output_ids=msg.output_ids,
            finished_reasons=msg.finished_reasons,
            meta_info=msg.meta_info,
            text_offsets=text_offsets,
            output_offsets=msg.output_offsets or [0] * n,
        )

    @staticmethod
    def _key(msg: BatchTokenIDOut, i: int) -> Hashable:
        """An n > 1 child is known by its parent and its name: a client may send a rid equal to
        a child's name (`abc-0` next to child 0 of `abc`), and both may be live at once."""
        parent = _item(msg.meta_info, i, {}).get("parent_rid")
        return msg.rids[i] if parent is None else (parent, msg.rids[i])

    def _status(self, key: Hashable, tail_ids: Sequence[int]) -> DecodeStatus:
        state = self.decode_status.get(key)
        if state is None:
            tail = list(tail_ids)
            state = DecodeStatus(decode_ids=tail, tail_len=len(tail), surr_offset=0, read_offset=len(tail))
            self.decode_status[key] = state
        return state

    def _advance(self, state: DecodeStatus, surr_text: str, read_text: str, params: DecodeParams,
                 finished: bool) -> None:
        """Move the ids decoded into complete characters (all of them at the finish) into the text."""
        if surr_text.endswith(REPLACEMENT_CHAR) and state.read_offset == state.tail_len > 0:
            # The prompt tail ends inside a character: its first output bytes would complete it
            # and shift every offset. Decode this request without left context instead.
            del state.decode_ids[:state.tail_len]
            state.tail_len, state.read_offset = 0, 0
            surr_text, read_text = "", self.decoder.decode([list(state.decode_ids)], params)[0]
        new_text = read_text[len(surr_text):]
        if finished or (new_text and not new_text.endswith(REPLACEMENT_CHAR)):
            state.decoded_text += new_text
            state.surr_offset = state.read_offset
            state.read_offset = len(state.decode_ids)
            if state.num_output_ids < params.min_new_tokens:
                state.stop_free_len = len(state.decoded_text)

    def _decode_windows(self, states: List[DecodeStatus],
                        params: List[DecodeParams]) -> Tuple[List[str], List[str]]:
        """Decode ids[surr:read] (context already shown) and ids[surr:] (context plus new ids),
        one batch call per distinct set of decode options."""
        groups: Dict[Tuple[bool, bool], List[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.skip_special_tokens, p.spaces_between_special_tokens), []).append(i)
        surr_texts, read_texts = [""] * len(states), [""] * len(states)
        for indices in groups.values():
            seqs = [states[i].decode_ids[states[i].surr_offset:states[i].read_offset] for i in indices]
            seqs += [states[i].decode_ids[states[i].surr_offset:] for i in indices]
            decoded = self.decoder.decode(seqs, params[indices[0]])
            for j, i in enumerate(indices):
                surr_texts[i], read_texts[i] = decoded[j], decoded[len(indices) + j]
        return surr_texts, read_texts

    @staticmethod
    def _visible_len(state: DecodeStatus, params: DecodeParams, finished: Optional[Dict[str, Any]],
                     stop_from_end: Optional[int] = None) -> int:
        """How much of the text the client may see after this update (never less than before).
        A stop-string finish is trimmed at the occurrence that stopped the request: where the
        scheduler says it starts, else the last one (the stopping one ends in the last token)."""
        text = state.decoded_text
        if finished is not None:
            matched = finished.get("matched") if finished.get("type") == "stop" else None
            if isinstance(matched, str) and matched and not params.no_stop_trim:
                pos = len(text) - stop_from_end if stop_from_end is not None else -1
                if not (0 <= pos and text.startswith(matched, pos)):
                    pos = text.rfind(matched)
                if pos != -1:
                    return max(pos, state.sent_offset)
            return len(text)
        if params.no_stop_trim:
            end = len(text)
        else:
            end = stop_safe_len(text, params.stop, state.sent_offset, state.stop_free_len)
        state.sent_offset = max(end, state.sent_offset)
        return state.sent_offset


def _item(values: Sequence[Any], i: int, default: Any) -> Any:
    """Optional per-request fields of `BatchTokenIDOut` may be left empty by the sender."""
    return values[i] if i < len(values) else default


def _load_tokenizer(server_args: Any) -> Any:
    try:
        from srt.utils.hf_transformers_utils import get_tokenizer
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(server_args.tokenizer_path,
                                             trust_remote_code=server_args.trust_remote_code)
    return get_tokenizer(server_args.tokenizer_path, trust_remote_code=server_args.trust_remote_code)


def _configure_logging(server_args: Any) -> None:
    try:
        from srt.utils.logging_utils import configure_logging
    except ImportError:
        logging.basicConfig(level=logging.INFO)
        return
    configure_logging(getattr(server_args, "log_level", None))


def _report(ready_writer: Any, message: Dict[str, Any]) -> None:
    if ready_writer is None:
        return
    try:
        ready_writer.send(message)
    except (OSError, ValueError):  # the parent is gone or closed its end; nobody to tell
        pass


def run_detokenizer_process(server_args: Any, port_args: Any, ready_writer: Any = None) -> None:
    """Process entry: load the tokenizer, PULL `BatchTokenIDOut` from the scheduler at
    `port_args.detokenizer_ipc_name` (bound here), PUSH results to `port_args.tokenizer_ipc_name`.
    Sends {"ok": True} or {"ok": False, "error": text} through `ready_writer`; exits on SIGTERM."""
    import setproctitle
    import zmq

    setproctitle.setproctitle("srt::detokenizer")
    _configure_logging(server_args)
    stopping: List[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    parent_pid = os.getppid()
    context = zmq.Context(1)
    try:
        manager = DetokenizerManager(_load_tokenizer(server_args))
        recv_socket = context.socket(zmq.PULL)
        recv_socket.bind(port_args.detokenizer_ipc_name)
        send_socket = context.socket(zmq.PUSH)
        send_socket.connect(port_args.tokenizer_ipc_name)
    except Exception as e:
        error = str(e) or type(e).__name__
        logger.error("Detokenizer failed to start: %s", error)
        _report(ready_writer, {"ok": False, "error": error})
        context.destroy(linger=0)
        raise SystemExit(1) from None
    _report(ready_writer, {"ok": True})
    poller = zmq.Poller()
    poller.register(recv_socket, zmq.POLLIN)
    try:
        while not stopping:
            if not poller.poll(POLL_INTERVAL_MS):
                if os.getppid() != parent_pid:
                    logger.warning("Detokenizer exits: its parent process %d is gone.", parent_pid)
                    break
                continue
            try:
                msg = ipc.recv(recv_socket)
            except ipc.IPCDecodeError as exc:  # a frame that is not ours: dropped, never executed
                logger.warning("Detokenizer dropped a message: %s", exc)
                continue
            ipc.send(send_socket, manager.handle(msg))
    except Exception as e:
        logger.exception("Detokenizer failed")
        _report(ready_writer, {"ok": False, "error": f"Detokenizer failed: {type(e).__name__}: {e}"})
        raise SystemExit(1) from None
    finally:
        context.destroy(linger=0)
        if ready_writer is not None:
            ready_writer.close()
    logger.info("Detokenizer stopped.")
