"""Turning one step's forward results into request state and the messages the front end reads."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from managers.finish_reason import FINISH_ABORT, FINISH_MATCHED_STR
from managers.io_struct import BatchTokenIDOut, DecodeParams
from managers.req import Req
from kernels.device_utils import host_to_device

if TYPE_CHECKING:
    from srt.layers.logits_processor import LogitsProcessorOutput
    from srt.layers.sampler import SampleOutputHost

logger = logging.getLogger(__name__)


def take_token(req: Req, i: int, token: int, sample: "SampleOutputHost", tokenizer: Any, budget_s: float) -> None:
    """Append the step's token and check whether `req` finished. When that work alone (stop
    matching, the grammar's advance) took longer than `budget_s` (--request-step-budget-ms, 0 = no
    bound), the request is aborted: one request must not hold every other one's step."""
    start = time.perf_counter()
    append_token(req, i, token, sample)
    req.check_finished(tokenizer)
    spent = time.perf_counter() - start
    if budget_s and spent > budget_s and not req.finished():
        message = (f"The request was aborted: its own work in one scheduler step (stop matching, grammar) took "
                   f"{spent * 1000:.0f} ms, over the {budget_s * 1000:g} ms budget (--request-step-budget-ms). "
                   f"Use fewer or simpler stop / stop_regex patterns.")
        logger.warning("Request %s: %s", req.rid, message)
        req.finished_reason = FINISH_ABORT(message, 400)


def append_token(req: Req, i: int, token: int, sample: "SampleOutputHost") -> None:
    """Append one output token and exactly one logprob entry for it (`sample` is the step's
    host copy, so nothing here reads the device)."""
    req.output_ids.append(token)
    if req.grammar is not None:
        req.grammar.accept_token(token)
    if not req.return_logprob or sample.logprobs is None:
        return
    req.output_token_logprobs_val.append(sample.logprobs[i])
    req.output_token_logprobs_idx.append(token)
    if req.top_logprobs_num and sample.top_logprobs is not None:
        vals, ids = sample.top_logprobs[i]
        req.output_top_logprobs_val.append(list(vals))
        req.output_top_logprobs_idx.append(list(ids))
    if req.token_ids_logprob and sample.token_ids_logprobs is not None:
        req.output_token_ids_logprobs.append(list(sample.token_ids_logprobs[i]))


INPUT_LOGPROB_CHUNK = 512  # prompt rows per log_softmax: bounds the fp32 temporary to 512 x vocab


def accumulate_input_logprobs(reqs: List[Req], logits_output: "LogitsProcessorOutput",
                              prefix_lens: List[int], seq_lens: List[int]) -> None:
    """Input logprobs: entry j is log p(token[s + j] | tokens before it), entry 0 is None; with
    `top_logprobs_num` also the top-k at each position (`input_top_logprobs`, entry 0 None).

    Rows of `input_token_logits` cover positions `[max(s, prefix), seq)` of each request; the row
    at position p scores token p + 1 (the row of the prompt's last position predicts the output).
    The log-softmax runs over chunks of rows, so a long prompt never holds a second [L, vocab]
    fp32 copy, and every value comes back to the host in one transfer.
    """
    logits = logits_output.input_token_logits
    if logits is None:
        return
    # Which (row, token) each entry reads, found on the host.
    plan, rows, cols, off = [], [], [], 0
    for req, p, s, n in zip(reqs, prefix_lens, seq_lens, logits_output.input_token_logits_lens):
        first, base = s - n, off
        off += n
        if n == 0 or not req.return_logprob or req.input_logprobs_done:
            continue
        ids = req.origin_input_ids
        toks = [ids[first + j + 1] for j in range(n) if first + j + 1 < len(ids)]
        plan.append((req, s, toks, len(rows)))
        rows.extend(range(base, base + len(toks)))
        cols.extend(toks)
    if not plan:
        return
    k = min(max(req.top_logprobs_num for req, *_ in plan), logits.shape[-1])
    device = logits.device
    rows_t, cols_t = host_to_device(rows, torch.int64, device), host_to_device(cols, torch.int64, device)
    picked, top_vals, top_ids = [], [], []
    for c in range(0, len(rows), INPUT_LOGPROB_CHUNK):
        chunk = torch.log_softmax(logits[rows_t[c:c + INPUT_LOGPROB_CHUNK]].float(), dim=-1)
        picked.append(chunk.gather(1, cols_t[c:c + INPUT_LOGPROB_CHUNK, None]).squeeze(1).double())
        if k:
            vals, idx = chunk.topk(k, dim=-1)
            top_vals.append(vals.double().flatten())
            top_ids.append(idx.double().flatten())  # ids < 2**53 are exact in float64
    flat = torch.cat(picked + top_vals + top_ids).tolist() if rows else []  # no scored position: entry 0 only
    total = len(rows)
    values, tv, ti = flat[:total], flat[total:total + total * k], flat[total + total * k:]
    for req, s, toks, start in plan:
        ids = req.origin_input_ids
        if req.input_token_logprobs_val is None:
            req.input_token_logprobs_val, req.input_token_logprobs_idx = [None], [ids[req.logprob_start_len]]
            if req.top_logprobs_num:
                req.input_top_logprobs_val, req.input_top_logprobs_idx = [None], [None]
        req.input_token_logprobs_val.extend(values[start : start + len(toks)])
        req.input_token_logprobs_idx.extend(toks)
        if req.top_logprobs_num:
            kk = req.top_logprobs_num
            for r in range(start, start + len(toks)):
                req.input_top_logprobs_val.append(tv[r * k : r * k + kk])
                req.input_top_logprobs_idx.append([int(t) for t in ti[r * k : r * k + kk]])
        if s >= len(ids):
            req.input_logprobs_done = True


def meta_info(req: Req, offset: int = 0) -> Dict[str, Any]:
    """The SGLang meta fields of one update: totals, the output logprob entries from `offset`
    on, and the input logprobs whole in the first update (`offset` 0), None after it."""
    meta: Dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "total_retractions": req.total_retractions,
    }
    if req.truncated_input_len is not None:
        meta["truncated_input_tokens"] = req.truncated_input_len
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [v, t] for v, t in zip(req.output_token_logprobs_val[offset:], req.output_token_logprobs_idx[offset:])]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [[v, t] for v, t in zip(vs, ts)]
                for vs, ts in zip(req.output_top_logprobs_val[offset:], req.output_top_logprobs_idx[offset:])]
        if req.token_ids_logprob:
            meta["output_token_ids_logprobs"] = [
                [[v, t] for v, t in zip(vals, req.token_ids_logprob)]
                for vals in req.output_token_ids_logprobs[offset:]]
        _add_input_logprobs(req, meta, first=offset == 0)
    if req.parent_rid is not None:
        meta["parent_rid"], meta["index"] = req.parent_rid, req.child_index
    return meta


def _add_input_logprobs(req: Req, meta: Dict[str, Any], first: bool) -> None:
    """The keys are in every update (the front end keeps their order); the values only in the first."""
    with_top = bool(req.top_logprobs_num)
    if req.input_token_logprobs_val is not None:
        meta["input_token_logprobs"] = None if not first else [
            [v, t] for v, t in zip(req.input_token_logprobs_val, req.input_token_logprobs_idx)]
        if with_top and req.input_top_logprobs_val is not None:
            meta["input_top_logprobs"] = None if not first else [
                None if vs is None else [[v, t] for v, t in zip(vs, ts)]
                for vs, ts in zip(req.input_top_logprobs_val, req.input_top_logprobs_idx)]
    elif req.logprob_start_len < 0 and req.origin_input_ids:
        # SGLang's -1: output logprobs only, and the input side is the last prompt token alone
        meta["input_token_logprobs"] = [[None, req.origin_input_ids[-1]]] if first else None
        if with_top:
            meta["input_top_logprobs"] = [None] if first else None


def should_send(req: Req, stream_interval: int = 1) -> bool:
    """Finished: always (once). Streaming: its first token, then each time its output crosses a
    multiple of --stream-interval (what the HTTP throttle lets through). Otherwise never."""
    if req.internal:
        return False
    if req.finished():
        return True
    sent, have = req.send_token_offset, len(req.output_ids)
    if not req.stream or have <= sent:
        return False
    return sent == 0 or have // stream_interval > sent // stream_interval


def build_output(reqs: List[Req], stream_interval: int = 1) -> Optional[BatchTokenIDOut]:
    """The update of the requests `should_send` picks, each carrying only what it has not sent
    yet (its `send_token_offset` moves past it); internal requests are never reported."""
    chosen = [r for r in reqs if should_send(r, stream_interval)]
    if not chosen:
        return None
    offsets = [r.send_token_offset for r in chosen]
    out = BatchTokenIDOut(
        rids=[r.rid for r in chosen],
        output_ids=[r.output_ids[off:] for r, off in zip(chosen, offsets)],
        finished_reasons=[r.finished_reason.to_json() if r.finished() else None for r in chosen],
        meta_info=[meta_info(r, off) for r, off in zip(chosen, offsets)],
        decode_params=[_decode_params(r) for r in chosen],
        input_tail_ids=[r.origin_input_ids[-INPUT_TAIL:] if off == 0 else [] for r, off in zip(chosen, offsets)],
        stop_str_from_end=[_stop_from_end(r) for r in chosen],
        output_offsets=offsets,
    )
    for r in chosen:
        r.send_token_offset = len(r.output_ids)
    return out


INPUT_TAIL = 5  # prompt tokens of left context for incremental detokenization


def _decode_params(req: Req) -> DecodeParams:
    sp = req.sampling_params
    return DecodeParams(sp.skip_special_tokens, sp.spaces_between_special_tokens, sp.no_stop_trim,
                        list(sp.stop or []), sp.min_new_tokens)


def _stop_from_end(req: Req) -> Optional[int]:
    reason = req.finished_reason
    return reason.from_end if isinstance(reason, FINISH_MATCHED_STR) else None
