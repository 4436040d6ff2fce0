"""The three process roles: tokenizer manager, scheduler, detokenizer."""
