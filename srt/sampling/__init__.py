"""Sampling: per-request `SamplingParams` and their batched tensor form, `SamplingBatchInfo`."""

from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams

__all__ = ["SamplingBatchInfo", "SamplingParams"]
