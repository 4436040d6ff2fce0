"""The soak's "evil" requests: each one alone used to freeze or stall the server.

Served (and checked): a forced run of "a" under an exponentially backtracking stop_regex beside a
3,000-character stop string that never matches; top logprobs at the --max-logprobs cap; an EBNF
constraint whose every output must be in its language. Refused with a 400 naming the flag: top
logprobs over the cap, too many or too long stop strings and regexes, a pattern RE2 cannot run,
too many logit_bias entries, an over-long rid, too many chat messages, a body with too many JSON
values. The fuzz draws from the same values (scripts/fuzz_server.py).
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

CATASTROPHIC_REGEXES = ["(a+)+b", "(a|aa)+$", "(.*a){20}$", "((a*)*)*b", "(a|a?)+c"]
YES_NO_EBNF = 'root ::= "yes" | "no"'
LIST_EBNF = 'root ::= item ("," item)*\nitem ::= [0-9] [0-9]?'
LIST_REGEX = r"[0-9][0-9]?(,[0-9][0-9]?)*"  # LIST_EBNF's language, for the check


def _finish(answer: Any) -> Optional[str]:
    meta = answer.get("meta_info") or {}
    return (meta.get("finish_reason") or {}).get("type")


def evil_served(rng: random.Random, text: str) -> Tuple[str, Dict[str, Any], Callable[[Any], Optional[str]]]:
    """(kind, body, check) of an evil request that must be served."""
    roll = rng.random()
    if roll < 0.4:
        pattern = rng.choice(CATASTROPHIC_REGEXES)
        n = rng.randint(20, 60)
        body = {"text": text, "sampling_params": {"max_new_tokens": n, "regex": "a{%d}" % n, "stop": ["z" * 3000],
                                                  "stop_regex": pattern}}

        def check(answer: Any) -> Optional[str]:
            if _finish(answer) not in ("stop", "length"):
                return f"catastrophic stop_regex {pattern!r}: finish {_finish(answer)}"
            return None if set(answer.get("text", "")) <= {"a"} else f"forced output not all 'a': {answer['text'][:40]!r}"
        return "evil_regex", body, check
    if roll < 0.7:
        m = rng.randint(4, 16)
        body = {"text": text, "return_logprob": True, "top_logprobs_num": 20,
                "sampling_params": {"max_new_tokens": m, "ignore_eos": True}}

        def check(answer: Any) -> Optional[str]:
            tops = (answer.get("meta_info") or {}).get("output_top_logprobs") or []
            return None if len(tops) == m and all(len(t) == 20 for t in tops) else "top logprobs at the cap: wrong shape"
        return "evil_logprobs", body, check
    # (grammar, its language, the prefixes of its language: an output cut by max_new_tokens)
    grammar, language, prefixes = rng.choice([(YES_NO_EBNF, "yes|no", "(y(es?)?|no?)?"),
                                              (LIST_EBNF, LIST_REGEX, r"([0-9][0-9]?(,[0-9][0-9]?)*,?)?")])
    body = {"text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "ebnf": grammar}}

    def check(answer: Any) -> Optional[str]:
        out, finish = answer.get("text", ""), _finish(answer)
        if re.fullmatch(prefixes if finish == "length" else language, out) is None:
            return f"ebnf output {out!r} (finish {finish}) is not in the language {language!r}"
        return None
    return "evil_ebnf", body, check


def evil_refused(rng: random.Random, text: str) -> Tuple[str, Any, str]:
    """(path, body, the flag the refusal must name)."""
    msgs: List[Dict[str, str]] = [{"role": "user", "content": "a"}] * 4097
    cases: List[Tuple[str, Any, str]] = [
        ("/generate", {"text": text, "return_logprob": True, "top_logprobs_num": rng.choice([21, 2048, 10**9])},
         "--max-logprobs"),
        ("/generate", {"text": text, "sampling_params": {"stop": [f"s{i}" for i in range(65)]}}, "--max-stop-sequences"),
        ("/generate", {"text": text, "sampling_params": {"stop": "x" * 5000}}, "--max-stop-chars"),
        ("/generate", {"text": text, "sampling_params": {"stop_regex": [f"a{i}" for i in range(200)]}},
         "--max-stop-sequences"),
        ("/generate", {"text": text, "sampling_params": {"stop_regex": r"(a)\1"}}, "RE2"),
        ("/generate", {"text": text, "sampling_params": {"logit_bias": {str(i): 1 for i in range(5000)}}},
         "--max-logit-bias"),
        ("/generate", {"text": text, "rid": "r" * 600}, "--max-rid-length"),
        ("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 1}, "--max-chat-messages"),
        ("/generate", b'{"text": "hi", "x": [' + b"[]," * 300000 + b"[]]}", "--max-request-json-items"),
    ]
    return rng.choice(cases)
