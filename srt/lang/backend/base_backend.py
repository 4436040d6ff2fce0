"""What every backend does with a program's expressions, on top of two native `/generate` calls.

A backend only needs `_generate(body)` (one native request, the parsed answer) and
`_generate_stream(body)` (cumulative streaming updates); the request shapes are SGLang's:
- `gen`: the program's text so far plus the gen's sampling params;
- `select`: one prefill-only request caches the shared prefix and tells its token count P, then
  one batch request scores every `prefix + choice` with input logprobs from P - 2, so each
  choice's score covers its own tokens and the prefix's last token (which absorbs a different
  tokenization at the boundary);
- `fork` / `run_batch`: a prefill-only request commits the shared prefix before the branches run.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

from srt.lang.chat_template import RoleTemplate
from srt.lang.choices import ChoicesDecision


class BackendError(RuntimeError):
    """The runtime refused or failed a program's request: its status and message."""

    def __init__(self, message: str, status_code: int = 500):
        super().__init__(f"{status_code}: {message}")
        self.message = message
        self.status_code = status_code


def check_finished(out: Dict[str, Any]) -> Dict[str, Any]:
    """An aborted generation is an error for the program, with the server's reason."""
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise BackendError(reason.get("message") or "request aborted", int(reason.get("status_code") or 500))
    return out


def mean_logprob(entries: List[list]) -> float:
    values = [e[0] for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


class BaseBackend:
    chat_template: Optional[RoleTemplate] = None

    # --------------------------------------------------------------- transport (subclasses)
    def _generate(self, body: Dict[str, Any]) -> Any:
        raise NotImplementedError

    def _generate_stream(self, body: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        raise NotImplementedError

    def flush_cache(self) -> Any:
        raise NotImplementedError

    def get_server_info(self) -> Dict[str, Any]:
        raise NotImplementedError

    # --------------------------------------------------------------- what programs call
    def get_chat_template(self) -> Optional[RoleTemplate]:
        return self.chat_template

    def cache_prefix(self, text: str) -> Dict[str, Any]:
        """Prefill `text` once (no token generated) so later requests that start with it hit the cache."""
        return check_finished(self._generate({"text": text, "sampling_params": {"max_new_tokens": 0}}))

    def generate(self, text: str, body: Dict[str, Any]) -> Tuple[Any, Any]:
        out = self._generate({"text": text, **body})
        if isinstance(out, list):  # n > 1: one result per sample
            return [check_finished(o)["text"] for o in out], [o["meta_info"] for o in out]
        return check_finished(out)["text"], out["meta_info"]

    def generate_stream(self, text: str, body: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any]]]:
        """(new text, meta info) per update; the server's updates are cumulative."""
        sent = 0
        for out in self._generate_stream({"text": text, **body, "stream": True}):
            check_finished(out)
            full = out["text"]
            yield full[sent:], out["meta_info"]
            sent = len(full)

    def select(self, text: str, choices: List[str], temperature: float, choices_method) -> ChoicesDecision:
        prompt_len = self.cache_prefix(text)["meta_info"]["prompt_tokens"]
        scored = self._generate({
            "text": [text + c for c in choices], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": max(prompt_len - 2, 0)})
        scored = [check_finished(o) for o in scored]
        inputs = [o["meta_info"]["input_token_logprobs"] for o in scored]
        outputs = [o["meta_info"]["output_token_logprobs"] for o in scored]
        normalized = [mean_logprob(x) for x in inputs]
        for i, entries in enumerate(inputs):
            if entries and entries[0][0] is None and entries[0][2] and text.endswith(entries[0][2]):
                inputs[i] = entries[1:]  # the boundary token is the prefix's own: not part of the choice
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            alone = self._generate({"input_ids": [[e[1] for e in x] for x in inputs],
                                    "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                    "logprob_start_len": 0})
            unconditional = [check_finished(o)["meta_info"]["input_token_logprobs"] for o in alone]
        return choices_method(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=inputs,
                              output_token_logprobs=outputs, unconditional_token_logprobs=unconditional)
