"""Model building blocks: norms, rotary embedding, linear layers, attention, logits."""
