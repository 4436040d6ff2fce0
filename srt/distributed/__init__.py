"""torch.distributed groups for tensor parallelism."""
