"""The front end's counters and latency histograms, read by /metrics (srt/entrypoints/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class LatencyHistogram:
    """Prometheus-style histogram: `counts[i]` observations <= `buckets[i]` (not cumulative), plus +Inf."""

    buckets: Tuple[float, ...]
    counts: List[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1


@dataclass
class TokenizerMetrics:
    """Front-end counters for /metrics; one finished output (an n > 1 child too) counts once."""

    num_requests: int = 0  # sent to the scheduler
    num_finished: int = 0
    num_aborted: int = 0  # abort finishes and client disconnects
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    time_to_first_token: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(TTFT_BUCKETS))
    inter_token_latency: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(ITL_BUCKETS))
    e2e_latency: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(E2E_BUCKETS))
