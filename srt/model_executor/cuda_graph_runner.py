"""`CudaGraphRunner`: decode replayed from captured CUDA graphs, one per batch-size bucket.

SGLang's design: static input buffers sized for the largest bucket; a decode batch of `raw`
requests is copied into them, padded up to the next captured size `bs` (padded rows have
seq_len 1, read request row 0 and write their KV to the dummy slot 0), the attention backend
refills its static metadata in place, the graph of `bs` replays, and the first `raw` rows of its
static output are returned. Batches above the largest bucket, and extend steps, run eagerly.

The same runner works without CUDA (`use_cuda_graph=False`): nothing is captured and "replay"
runs the forward eagerly on the same padded static buffers, so the bucketing, padding and
static-buffer logic is exercised (and tested) on CPU. `--enable-torch-compile` swaps the forward
of buckets up to `--torch-compile-max-bs` for a `torch.compile`d one (captured inside the graphs
on CUDA, a speed option on CPU).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Dict, List, Optional

import torch

from srt.layers.logits_processor import LogitsProcessorOutput
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from kernels.device_utils import is_cuda

logger = logging.getLogger(__name__)

DEFAULT_CUDA_GRAPH_MAX_BS = 160
# A capture slower than this (all buckets together) logs how to skip it.
SLOW_CAPTURE_SECONDS = 120.0
SKIP_HINT = ("Use --disable-cuda-graph to skip the capture, or lower --cuda-graph-max-bs / "
             "set --cuda-graph-bs to capture fewer batch sizes.")


def get_batch_sizes_to_capture(server_args, max_running_requests: int) -> List[int]:
    """`--cuda-graph-bs` as given, else 1, 2, 4, 8, 16, 24, 32, ... up to `--cuda-graph-max-bs`
    (default min(160, max_running_requests)); never above `max_running_requests`."""
    if server_args.cuda_graph_bs:
        sizes = sorted(set(int(b) for b in server_args.cuda_graph_bs))
    else:
        max_bs = server_args.cuda_graph_max_bs or min(DEFAULT_CUDA_GRAPH_MAX_BS, max_running_requests)
        sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
        if sizes[-1] != max_bs:
            sizes.append(max_bs)
    kept = [b for b in sizes if b <= max_running_requests]
    if len(kept) < len(sizes):
        logger.info("CUDA graph batch sizes above --max-running-requests=%d are not captured: %s.",
                    max_running_requests, [b for b in sizes if b > max_running_requests])
    return kept or [max_running_requests]


def cuda_graph_reserve_bytes(model_config, max_bs: int, max_kv_len: int, dtype: torch.dtype,
                             backend: str) -> int:
    """Memory the captured graphs keep outside the KV pool (their shared pool holds the largest
    bucket's activations): logits in fp32, the sampler's copies of them, hidden/MLP activations,
    and for torch_native the gathered K/V of a full-width decode. Plus a fixed 64 MiB for the
    graphs themselves and the static metadata."""
    elt = torch.empty((), dtype=dtype, device="cpu").element_size()
    hidden, inter = model_config.hidden_size, model_config.intermediate_size
    per_row = 3 * 4 * model_config.vocab_size + elt * (8 * hidden + 3 * inter)
    if backend == "torch_native":
        per_row += 2 * elt * max_kv_len * model_config.num_key_value_heads * model_config.head_dim  # tp = 1: upper bound
        per_row += 8 * max_kv_len  # int64 gather indices
    return 64 * (1 << 20) + max_bs * per_row


def capture_max_bs(server_args) -> int:
    """The largest bucket as far as the flags say (before max_running_requests is known)."""
    if server_args.cuda_graph_bs:
        return max(server_args.cuda_graph_bs)
    return server_args.cuda_graph_max_bs or min(DEFAULT_CUDA_GRAPH_MAX_BS, server_args.max_running_requests
                                                 or DEFAULT_CUDA_GRAPH_MAX_BS)


def graph_reserve_bytes(server_args, model_config, device_kind: str, backend: str) -> int:
    """What the default --mem-fraction-static leaves aside for CUDA graphs (0 when not captured)."""
    if device_kind != "cuda" or server_args.disable_cuda_graph:
        return 0
    return cuda_graph_reserve_bytes(model_config, capture_max_bs(server_args), model_config.context_len + 4,
                                    model_config.dtype, backend)


class CudaGraphRunner:
    def __init__(self, model_runner, capture_bs: Optional[List[int]] = None,
                 use_cuda_graph: Optional[bool] = None, enable_torch_compile: Optional[bool] = None):
        self.model_runner = model_runner
        args = model_runner.server_args
        self.device = torch.device(model_runner.device)
        self.use_cuda_graph = is_cuda(self.device) if use_cuda_graph is None else use_cuda_graph
        self.capture_bs = sorted(capture_bs or get_batch_sizes_to_capture(args, model_runner.max_running_requests))
        self.max_bs = max(self.capture_bs)
        self.compile_bs = set()
        if args.enable_torch_compile if enable_torch_compile is None else enable_torch_compile:
            self.compile_bs = {b for b in self.capture_bs if b <= args.torch_compile_max_bs}
        self.max_kv_len = model_runner.req_to_token_pool.req_to_token.shape[1]
        self.attn_backend = model_runner.attn_backend

        def buffer(fill: int = 0) -> torch.Tensor:
            return torch.full((self.max_bs,), fill, dtype=torch.int64, device=self.device)

        self.input_ids = buffer()
        self.req_pool_indices = buffer()
        self.seq_lens = buffer(1)
        self.out_cache_loc = buffer()  # padded rows write the dummy slot 0
        self.positions = buffer()
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_kv_len)
        self._compiled: Optional[Callable] = None
        self.graphs: Dict[int, "torch.cuda.CUDAGraph"] = {}
        self.outputs: Dict[int, LogitsProcessorOutput] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.capture()

    # ------------------------------------------------------------------ helpers
    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs

    def bucket(self, raw_bs: int) -> int:
        return self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]

    def _static_batch(self, bs: int, seq_lens_cpu: List[int], rows_cpu: List[int]) -> ForwardBatch:
        runner = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu, req_pool_indices_cpu=rows_cpu,
            req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=self.attn_backend,
        )

    def _forward_fn(self, bs: int) -> Callable[[ForwardBatch], LogitsProcessorOutput]:
        model = self.model_runner.model
        if bs not in self.compile_bs:
            return lambda fb: model.forward(fb.input_ids, fb.positions, fb)
        if self._compiled is None:
            import torch._dynamo

            # One graph per bucket (dynamic=False): allow a cache entry for each.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                        2 * len(self.capture_bs) + 8)
            self._compiled = torch.compile(model.forward, dynamic=False)
        compiled = self._compiled
        return lambda fb: compiled(fb.input_ids, fb.positions, fb)

    # ------------------------------------------------------------------ capture
    def capture(self) -> None:
        """Capture every bucket (largest first). Without CUDA graphs only the backend's capture
        hook runs per bucket (it sets up what a replay of that size refills)."""
        if not self.use_cuda_graph:
            for bs in self.capture_bs:
                self.attn_backend.init_forward_metadata_capture_cuda_graph(bs, self._static_batch(bs, [1] * bs, [0] * bs))
            return
        from tqdm import tqdm

        start = time.perf_counter()
        bs = self.capture_bs[-1]
        try:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
            self.graph_pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
            for bs in tqdm(list(reversed(self.capture_bs)), desc="Capturing CUDA graphs", unit="bs"):
                self._capture_one(bs)  # largest first: the smaller ones reuse its memory pool
            torch.cuda.synchronize(self.device)
            self.capture_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        except Exception as exc:
            raise RuntimeError(f"CUDA graph capture failed at batch size {bs}: {type(exc).__name__}: {exc}. "
                               f"{SKIP_HINT}") from exc
        self.capture_seconds = time.perf_counter() - start
        logger.info("Captured CUDA graphs for batch sizes %s in %.1f s, using %.2f GiB.",
                    self.capture_bs, self.capture_seconds, self.capture_bytes / (1 << 30))
        if self.capture_seconds > SLOW_CAPTURE_SECONDS:
            logger.warning("CUDA graph capture took %.0f s. %s", self.capture_seconds, SKIP_HINT)

    @torch.inference_mode()
    def _capture_one(self, bs: int) -> None:
        fb = self._static_batch(bs, [1] * bs, [0] * bs)
        self.attn_backend.init_forward_metadata_capture_cuda_graph(bs, fb)
        forward = self._forward_fn(bs)
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm-up: allocator, cuBLAS handles, torch.compile
                forward(fb)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool, stream=self.stream):
            out = forward(fb)
        self.graphs[bs], self.outputs[bs] = graph, out

    # ------------------------------------------------------------------ replay
    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        raw = fb.batch_size
        bs = self.bucket(raw)
        if bs != raw:
            self.seq_lens[raw:bs].fill_(1)
            self.out_cache_loc[raw:bs].zero_()
            self.req_pool_indices[raw:bs].zero_()
            self.input_ids[raw:bs].zero_()
        self.input_ids[:raw].copy_(fb.input_ids)
        self.req_pool_indices[:raw].copy_(fb.req_pool_indices)
        self.seq_lens[:raw].copy_(fb.seq_lens)
        self.out_cache_loc[:raw].copy_(fb.out_cache_loc)
        torch.sub(self.seq_lens[:bs], 1, out=self.positions[:bs])
        pad = bs - raw
        static = self._static_batch(bs, list(fb.seq_lens_cpu) + [1] * pad, list(fb.req_pool_indices_cpu) + [0] * pad)
        static.sampling_info = fb.sampling_info
        self.attn_backend.init_forward_metadata_replay_cuda_graph(bs, static)
        if self.use_cuda_graph:
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:
            out = self._forward_fn(bs)(static)
        return LogitsProcessorOutput(out.next_token_logits[:raw])
