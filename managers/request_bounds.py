"""Request bounds the tokenizer manager checks before anything reaches the scheduler: batch and
fan-out sizes (--max-batch-items, --max-n), per-request work caps (--max-logprobs, stop strings
and regexes, logit_bias, rid length), prompt length against the context, token ids against the
vocabulary, and admission's max_new_tokens clamp (applied here so meta_info reports it)."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple

from managers.generate_input import GenerateReqInput, GenerateReqItem, RequestError, RequestLimits
from managers.prompt_tokenizer import Encoded
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import flag_default

logger = logging.getLogger(__name__)

CONTEXT_CODE = "context_length_exceeded"


def server_flag(server_args: Any, name: str) -> int:
    """`server_args.name`, or the flag's ServerArgs default when the object does not carry it."""
    value = getattr(server_args, name, None)
    return int(flag_default(name) if value is None else value)


class RequestBounds:
    """Every per-request limit check, each refusal a 400 naming the parameter and the flag."""

    def __init__(self, server_args: Any, limits: RequestLimits, context_len: int, vocab_size: int):
        self.server_args = server_args
        self.limits = limits
        self.context_len = context_len
        self.vocab_size = vocab_size

    def _flag(self, name: str) -> int:
        return server_flag(self.server_args, name)

    def check_batch_size(self, obj: GenerateReqInput) -> None:
        """--max-batch-items, counted before the batch is normalized (cheap to refuse, not to walk)."""
        count, limit = obj.num_prompts, self._flag("max_batch_items")
        if count > limit:
            name = "text" if obj.text is not None else "input_ids"
            raise RequestError(f"{name} holds {count} prompts, more than one request may carry ({limit}, "
                               f"--max-batch-items={limit}). Send smaller batches or raise --max-batch-items.",
                               400, code="invalid_request_error", param=name)

    def check_input_ids_lengths(self, obj: GenerateReqInput) -> None:
        """An input_ids prompt at or over the context length is refused before its ids are walked
        (millions of ids take a second of the event loop to check one by one)."""
        ids = obj.input_ids
        if obj.text is not None or not isinstance(ids, list) or getattr(self.server_args, "allow_auto_truncate", False):
            return
        for row in ids if ids and isinstance(ids[0], list) else [ids]:
            if isinstance(row, list) and len(row) >= self.context_len:
                raise self.too_long(Encoded(row))

    def check_fan_out(self, items: List[GenerateReqItem]) -> None:
        """--max-n per prompt, and --max-batch-items over every output (prompts x n): the scheduler
        runs one request per output. Malformed `n` values are left to SamplingParams.verify."""
        max_n, limit = self._flag("max_n"), self._flag("max_batch_items")
        total = 0
        for item in items:
            n = item.sampling_params.get("n")
            n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
            if n > max_n:
                raise RequestError(f"n={n} asks for more samples per prompt than this server allows ({max_n}, "
                                   f"--max-n={max_n}). Lower n or raise --max-n.", 400,
                                   code="invalid_request_error", param="n")
            total += n
        if total > limit:
            raise RequestError(f"The request asks for {total} outputs ({len(items)} prompts, n summed over them), "
                               f"more than one request may ask for ({limit}, --max-batch-items={limit}). Send "
                               f"fewer prompts or a smaller n, or raise --max-batch-items.", 400,
                               code="invalid_request_error", param="n")

    def check_work_caps(self, items: List[GenerateReqItem]) -> None:
        """Caps on what one request makes the server do per step or per response, checked on the
        raw fields before anything walks them (10,000 stop patterns or 1M logit_bias keys are
        refused in microseconds). Malformed values are left to SamplingParams.verify."""
        for item in items:
            self._cap(len(item.rid), "max_rid_length", "rid", "characters")
            cap = self._flag("max_logprobs")
            top = item.top_logprobs_num
            if isinstance(top, int) and top > cap:
                raise self._over("top_logprobs_num", top, cap, "max_logprobs", "top logprobs per token")
            if isinstance(item.token_ids_logprob, list) and len(item.token_ids_logprob) > cap:
                raise self._over("token_ids_logprob", len(item.token_ids_logprob), cap, "max_logprobs", "token ids")
            params = item.sampling_params
            for name in ("stop", "stop_regex"):
                value = params.get(name)
                values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
                self._cap(len(values), "max_stop_sequences", f"sampling_params.{name}", "entries")
                chars = sum(len(v) for v in values if isinstance(v, str))
                self._cap(chars, "max_stop_chars", f"sampling_params.{name}", "characters in all")
            bias = params.get("logit_bias")
            if isinstance(bias, dict):
                self._cap(len(bias), "max_logit_bias", "sampling_params.logit_bias", "entries")

    def check_chat_messages(self, messages: Any) -> None:
        if isinstance(messages, list):
            self._cap(len(messages), "max_chat_messages", "messages", "messages")

    def _cap(self, count: int, flag: str, param: str, unit: str) -> None:
        limit = self._flag(flag)
        if count > limit:
            raise self._over(param, count, limit, flag, unit)

    @staticmethod
    def _over(param: str, count: int, limit: int, flag: str, unit: str) -> RequestError:
        option = "--" + flag.replace("_", "-")
        return RequestError(f"{param} holds {count} {unit}, more than this server allows ({limit}, {option}={limit}). "
                            f"Send at most {limit}, or start the server with a larger {option}.", 400,
                            code="invalid_request_error", param=param)

    def check_context(self, enc: Encoded, sp: SamplingParams, explicit_max_new: bool,
                       rid: str) -> Tuple[List[int], Dict[str, Any]]:
        """SGLang's two front-end length checks (with --allow-auto-truncate they trim instead), then
        admission's max_new_tokens clamp, applied here so that it is reported."""
        C, L, ids = self.context_len, enc.length, enc.ids
        meta: Dict[str, Any] = {}
        auto = bool(getattr(self.server_args, "allow_auto_truncate", False))
        if L >= C:
            if not auto:
                raise self.too_long(enc)
            logger.warning("Request %s: input of %s%d tokens truncated to %d (context length %d, "
                           "--allow-auto-truncate).", rid, "" if enc.complete else "at least ", L, C - 1, C)
            meta.update(truncated=True, truncated_input_tokens=L)  # what the client sent (a lower bound if cut)
            ids, L = ids[: C - 1], C - 1
        M = sp.max_new_tokens
        if explicit_max_new and L + M >= C and not auto:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {C} tokens. "
                f"You requested a total of {L + M} tokens: {L} tokens from the input messages and {M} "
                f"tokens for the completion. Please reduce the number of tokens in the input messages or "
                f"the completion to fit within the limit.", 400, code=CONTEXT_CODE)
        self._clamp_max_new_tokens(L, sp, meta, rid)
        return ids, meta

    def too_long(self, enc: Encoded) -> RequestError:
        C = self.context_len
        size = f"{enc.length} tokens" if enc.complete else f"at least {enc.length} tokens"
        return RequestError(f"The input ({size}) is longer than the model's context length ({C} tokens). Use a "
                            f"shorter input, or start the server with --allow-auto-truncate to keep the first "
                            f"{C - 1} tokens.", 400, code=CONTEXT_CODE)

    def _clamp_max_new_tokens(self, L: int, sp: SamplingParams, meta: Dict[str, Any], rid: str) -> None:
        """Admission's clamp (`RequestLimits.max_new_tokens_for`), done here so meta_info reports it;
        the scheduler's own clamp then changes nothing. Prompts admission refuses are left to it."""
        limits = self.limits
        if getattr(self.server_args, "allow_auto_truncate", False):
            L = min(L, limits.max_req_input_len)  # what admission truncates to
        elif L >= limits.max_req_input_len:
            return
        M, room = sp.max_new_tokens, limits.max_new_tokens_for(L)
        if M <= room:
            return
        sp.max_new_tokens = room
        sp.min_new_tokens = min(sp.min_new_tokens, room)
        reason = (f"a request may hold at most {limits.max_total_tokens} tokens (prompt + completion), "
                  f"set by {limits.bound()}")
        logger.info("Request %s: max_new_tokens %d clamped to %d (input %d tokens; %s).", rid, M, room, L, reason)
        meta["max_new_tokens_clamped"] = {"requested": M, "used": room, "reason": reason}

    def check_token_ids(self, ids: List[int], name: str) -> None:
        V = self.vocab_size
        if not ids or (min(ids) >= 0 and max(ids) < V):  # C-speed scan; the loop only to name the culprit
            return
        for pos, tid in enumerate(ids):
            if not 0 <= tid < V:
                raise RequestError(f"{name} contains token id {tid} at position {pos}, outside the vocabulary "
                                   f"[0, {V}).", 400, code="invalid_request_error", param=name)
