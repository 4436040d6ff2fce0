"""Model execution, server arguments and entrypoints."""
