"""llguidance (a Rust library with Python bindings, no required dependencies) behind the grammar
interface. Regexes and JSON schemas go through llguidance's own compilers; EBNF (GBNF syntax)
through its GBNF-to-Lark converter. Only the client's grammar text becomes a `GrammarError`; any
other exception is the backend's own fault and propagates as such."""

from __future__ import annotations

import json

import torch

from srt.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, GrammarError, GrammarKey

_BITS = torch.arange(32, dtype=torch.int32, device="cpu")


class GuidanceGrammar(BaseGrammarObject):
    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def bitmask_bytes(self) -> bytes:
        """The allowed tokens packed 32 per int32 word (bit set = allowed), as llguidance gives them."""
        return self.matcher.compute_bitmask()

    def fill_vocab_mask(self, mask_row: torch.Tensor) -> None:
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        allowed = ((words[:, None] >> _BITS) & 1).view(-1)[: mask_row.numel()]
        mask_row[: allowed.numel()] = allowed == 0
        mask_row[allowed.numel():] = True

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.consume_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def copy(self) -> "GuidanceGrammar":
        return GuidanceGrammar(self.matcher.deep_copy(), self.vocab_size)


def structural_tags(text: str):
    """SGLang's structural tag, `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`:
    free text, in which each segment that starts with a trigger is `begin`, JSON of its schema, `end`."""
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise GrammarError("structural_tag", f"not valid JSON: {exc}") from None
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise GrammarError("structural_tag", "needs non-empty lists 'structures' and 'triggers'")
    out = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("begin", "end")):
            raise GrammarError("structural_tag", f"structures[{i}] needs string 'begin' and 'end' and a 'schema'")
        trigger = next((t for t in triggers if isinstance(t, str) and t and item["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError("structural_tag", f"structures[{i}].begin {item['begin']!r} starts with no trigger")
        if not isinstance(item.get("schema", {}), dict):
            raise GrammarError("structural_tag", f"structures[{i}].schema must be a JSON object")
        schema = dict(item.get("schema") or {})
        schema.setdefault("x-guidance", {"whitespace_flexible": False})  # compact JSON, as for json_schema
        out.append((trigger, item["begin"], schema, item["end"]))
    return out


def ebnf_to_lark(text: str) -> str:
    """GBNF (`root ::= ...`, as xgrammar takes SGLang's `ebnf`) to llguidance's Lark. Strictly GBNF:
    `any_to_lark` would also pass Lark through, but it sniffs Lark by a `start:` line, which a GBNF
    rule `start ::= ...` also matches, and a Lark grammar would not be portable to xgrammar."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except GbnfToLarkError as exc:
        raise GrammarError("ebnf", str(exc)) from None
    except RecursionError:
        raise GrammarError("ebnf", "the grammar nests groups too deeply") from None
    except Exception as exc:
        # The converter reports a missing `root`, an undefined or a duplicate rule as a plain
        # Exception; a subclass (TypeError, KeyError...) is a fault of the converter, not the text.
        if type(exc) is not Exception:
            raise
        raise GrammarError("ebnf", str(exc)) from None


class GuidanceBackend(BaseGrammarBackend):
    def __init__(self, tokenizer, vocab_size: int):
        super().__init__()
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def _structural_tag_lark(self, text: str) -> str:
        tags = [self._ll.StructTag(trigger=t, begin=b, grammar=g, end=e) for t, b, g, e in structural_tags(text)]
        return self._ll.StructTag.to_grammar(tags, assume_special=False)

    def _compile(self, key: GrammarKey) -> GuidanceGrammar:
        kind, text = key
        matcher_cls = self._ll.LLMatcher
        if kind == "regex":
            grammar, field = matcher_cls.grammar_from_regex(text), "regex"
        elif kind == "json":
            try:
                schema = json.loads(text)
            except ValueError as exc:
                raise GrammarError("json_schema", f"not valid JSON: {exc}") from None
            # Compact separators unless the schema's own "x-guidance" says otherwise: a flexible
            # whitespace rule would let a weak model pad forever instead of closing the object.
            defaults = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
            try:
                grammar, field = matcher_cls.grammar_from_json_schema(schema, defaults=defaults), "json_schema"
            except ValueError as exc:  # documented: the schema or its "x-guidance" is not a JSON object
                raise GrammarError("json_schema", str(exc)) from None
        elif kind == "structural_tag":
            grammar, field = matcher_cls.grammar_from_lark(self._structural_tag_lark(text)), "structural_tag"
        else:
            grammar, field = matcher_cls.grammar_from_lark(ebnf_to_lark(text)), "ebnf"
        is_error, messages = matcher_cls.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(field, messages[0] if messages else "invalid grammar")
        matcher = matcher_cls(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(field, matcher.get_error())
        return GuidanceGrammar(matcher, self.vocab_size)
