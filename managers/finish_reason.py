"""Why a request stopped, in the JSON shape SGLang clients read from `meta_info.finish_reason`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union


class BaseFinishReason:
    is_error = False

    def to_json(self) -> Dict[str, Any]:
        raise NotImplementedError


@dataclass
class FINISH_LENGTH(BaseFinishReason):
    length: int

    def to_json(self) -> Dict[str, Any]:
        return {"type": "length", "length": self.length}


@dataclass
class FINISH_MATCHED_TOKEN(BaseFinishReason):
    matched: int

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FINISH_MATCHED_STR(BaseFinishReason):
    matched: str
    # Characters from the start of the stopping occurrence to the end of the output text (as the
    # scheduler decoded its tail): the detokenizer trims there, not at an earlier occurrence that
    # `min_new_tokens` ignored. Not part of the client-visible JSON.
    from_end: Optional[int] = field(default=None, compare=False)

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FINISH_ABORT(BaseFinishReason):
    message: str = "Aborted"
    status_code: Optional[int] = None
    err_type: Optional[str] = None
    is_error = True

    def to_json(self) -> Dict[str, Any]:
        return {"type": "abort", "message": self.message, "status_code": self.status_code}


FinishReason = Union[FINISH_LENGTH, FINISH_MATCHED_TOKEN, FINISH_MATCHED_STR, FINISH_ABORT]


def is_queue_full(finish: Dict[str, Any]) -> bool:
    """A 503 for a full queue (a finish's JSON) is the server shedding load, not an aborted request."""
    return finish.get("status_code") == 503 and str(finish.get("message", "")).startswith("The request queue is full.")
