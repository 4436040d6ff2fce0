"""How `select` picks among its choices from the logprobs the server computed.

Each method gets, per choice, the prompt-logprob entries `[logprob, token_id, text]` of the
tokens after the shared prefix (plus the prefix's last token, whose logprob absorbs a different
tokenization at the boundary) and their mean (`normalized_prompt_logprobs`), as SGLang defines
them. The names and the meta info they return follow `sglang.lang.choices`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: Optional[Dict[str, Any]] = None


def _values(entries: List[list]) -> List[float]:
    return [e[0] for e in entries if e[0] is not None]


def _argmax(scores: List[float]) -> int:
    return max(range(len(scores)), key=lambda i: (scores[i], -i))  # first of equal scores, as numpy


class ChoicesSamplingMethod:
    requires_unconditional_logprobs = False

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        raise NotImplementedError

    @staticmethod
    def _meta(normalized, inputs, outputs) -> Dict[str, Any]:
        return {"normalized_prompt_logprobs": normalized, "input_token_logprobs": inputs,
                "output_token_logprobs": outputs}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (the default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], self._meta(normalized_prompt_logprobs, input_token_logprobs,
                                                         output_token_logprobs))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token, keep the choices whose logprob at that position is the highest; a shorter
    choice is padded with its own mean so it can still be compared with longer ones."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        rows = [_values(entries) for entries in input_token_logprobs]
        width = max(len(r) for r in rows)
        matrix = [r + [sum(r) / len(r)] * (width - len(r)) for r in rows]
        remaining = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == top]
            if len(remaining) == 1:
                break
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[remaining[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (logprob in context - logprob of the same tokens alone),
    which stops frequent words from winning on frequency; the first unconditional logprob counts 0."""

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional token logprobs")
        scores = []
        for entries, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            diffs = [(e[0] or 0.0) - (u[0] or 0.0) for e, u in zip(entries, uncond)]
            scores.append(sum(diffs) / len(diffs))
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[_argmax(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
