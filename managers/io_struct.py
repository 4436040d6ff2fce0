"""Every message that crosses a process boundary (tokenizer manager <-> scheduler <-> detokenizer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional

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
    extra_key: Optional[Hashable] = None


@dataclass
class AbortReq:
    rid: str = ""  # matches every rid that starts with it
    abort_all: bool = False


@dataclass
class FlushCacheReqInput:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class BatchTokenIDOut:
    """Per-step update of requests that finished or stream. `output_ids` are cumulative; each
    request's `meta_info` carries the SGLang meta fields (prompt/completion/cached tokens, ...)."""

    rids: List[str]
    output_ids: List[List[int]]
    finished_reasons: List[Optional[Dict[str, Any]]]
    meta_info: List[Dict[str, Any]] = field(default_factory=list)
