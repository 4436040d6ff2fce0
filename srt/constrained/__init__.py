"""Grammar-constrained decoding: one small interface (`base_grammar_backend`) over a well-kept
library (llguidance), used by the scheduler for requests with regex / json_schema / ebnf."""
