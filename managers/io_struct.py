"""Every message that crosses a process boundary (tokenizer manager <-> scheduler <-> detokenizer).

Flow: TokenizerManager --TokenizedGenerateReqInput/AbortReq/FlushCacheReqInput/...--> Scheduler
--BatchTokenIDOut (and replies)--> Detokenizer --BatchStrOut (replies forwarded)--> TokenizerManager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from srt.sampling.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: List[int]
    sampling_params: SamplingParams
    input_text: Optional[str] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[List[int]] = None
    stream: bool = False
    extra_key: Optional[Union[str, Tuple[str, str]]] = None  # cache namespace: extra_key and/or cache_salt
    data_parallel_rank: Optional[int] = None  # a replica the caller chose (else the controller picks)


@dataclass
class AbortReq:
    rid: str = ""  # the client's rid, matched exactly; n > 1 children match through their parent_rid
    abort_all: bool = False


@dataclass
class StopSchedulerReq:
    """TP rank 0 to the other ranks: leave the loop (rank 0 got SIGTERM)."""


@dataclass
class FlushCacheReqInput:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetLoadReqInput:
    """Ask the scheduler for its live numbers (running, queued, token usage, counters)."""


@dataclass
class GetLoadReqOutput:
    num_running_reqs: int
    num_waiting_reqs: int
    token_usage: float
    max_total_num_tokens: int
    counters: Dict[str, float] = field(default_factory=dict)
    dp_rank: int = 0  # the replica that answered; -1 for totals merged over replicas
    replicas: List[Dict[str, Any]] = field(default_factory=list)  # per replica, when merged (dp > 1)
    # KV conservation at the time of the reply: available_size + evictable_size + protected_size ==
    # max_total_num_tokens, and num_free_req_slots == num_req_slots once nothing runs.
    memory: Dict[str, int] = field(default_factory=dict)


@dataclass
class DecodeParams:
    """How the detokenizer turns a request's ids into text."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: List[str] = field(default_factory=list)
    min_new_tokens: int = 0  # a stop ending in the first min_new_tokens - 1 tokens never stops: stream it


@dataclass
class BatchTokenIDOut:
    """Per-step update of requests that finished or stream, incremental: `output_ids[i]` are the
    ids of rid i from position `output_offsets[i]` of its output on (empty offsets: 0, the whole
    output). The output logprob lists in `meta_info[i]` start at the same position; the input
    logprobs come whole in a rid's first update and are None after it. The other meta fields
    (prompt/completion/cached tokens, ...) are totals. `input_tail_ids` are the last prompt tokens
    (left context for detokenizing the first outputs), sent with a rid's first update only."""

    rids: List[str]
    output_ids: List[List[int]]
    finished_reasons: List[Optional[Dict[str, Any]]]
    meta_info: List[Dict[str, Any]] = field(default_factory=list)
    decode_params: List[DecodeParams] = field(default_factory=list)
    input_tail_ids: List[List[int]] = field(default_factory=list)
    # Per finished stop-string request: characters from the start of the stopping occurrence to
    # the end of the output text (None: not a stop-string finish, or unknown).
    stop_str_from_end: List[Optional[int]] = field(default_factory=list)
    output_offsets: List[int] = field(default_factory=list)


@dataclass
class BatchStrOut:
    """Detokenized update, incremental like `BatchTokenIDOut`: `texts[i]` is the piece of rid i's
    text that starts at character `text_offsets[i]`, `output_ids[i]` (and the output logprob lists
    of `meta_info[i]`) the piece from `output_offsets[i]`. The receiver writes each piece at its
    offset, so empty offsets (0) make an update cumulative. Text never shrinks between updates."""

    rids: List[str]
    texts: List[str]
    output_ids: List[List[int]]
    finished_reasons: List[Optional[Dict[str, Any]]]
    meta_info: List[Dict[str, Any]] = field(default_factory=list)
    text_offsets: List[int] = field(default_factory=list)
    output_offsets: List[int] = field(default_factory=list)


@dataclass
class SchedulerReady:
    """Start-up handshake from the scheduler process (or the root-cause error text)."""

    ok: bool
    error: str = ""
    max_total_num_tokens: int = 0
    max_req_input_len: int = 0
    max_req_len: int = 0
    max_running_requests: int = 0
    context_len: int = 0
    vocab_size: int = 0
    kv_budget: Dict[str, Any] = field(default_factory=dict)  # KVBudget.to_dict(): the start-up arithmetic
