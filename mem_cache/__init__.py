"""Where KV lives and who may reuse it: pools, slot allocator, prefix caches."""
