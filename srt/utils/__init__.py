"""Small shared utilities (tokenizer loading, logging)."""
