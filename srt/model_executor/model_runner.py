"""`ModelRunner`: owns the model, the KV pools and the attention backend; runs one step."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from kernels.attention import create_attention_backend, resolve_attention_backend
from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.configs.model_config import ModelConfig
from srt.layers.cpu_fused_ops import cpu_extend_uses_op
from srt.layers.cpu_weight_packing import frozen_weight_nbytes, pack_model_weights, uses_panel_gemm, widens_bf16
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.sampler import SampleOutput, Sampler
from srt.distributed.parallel_state import all_reduce_min_int, broadcast_tensor, init_tp_group
from srt.distributed.tp_config import check_tp_size, cpu_fraction_share, local_rank_count, num_kv_heads_per_rank
from srt.model_executor.cpu_decode_runner import CpuDecodeRunner
from srt.model_executor.compile_warmup import compile_decode_forward, warmup_compiled_decode
from srt.model_executor.cuda_graph_runner import CudaGraphRunner, graph_reserve_bytes
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_executor.memory_sizing import (
    KVBudget, MemoryReading, compute_kv_budget, default_mem_fraction_static, fixed_kv_budget,
    free_memory_after_load, read_free_memory,
)
from srt.model_loader.loader import get_model, warn_slow_cpu_bf16
from srt.server_args import ServerArgs
from srt.utils.host_allocator import tune_host_allocator

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available (torch "
                         f"{torch.__version__}); use --device cpu or auto.")
    return device


class ModelRunner:
    """Loads the model and sizes the pools: `max_total_num_tokens` KV slots and
    `max_running_requests` request rows of `context_len + 4` columns.

    Without `max_total_tokens` the pool is sized from free memory measured around weight
    loading (ARCHITECTURE.md 4.3, `memory_sizing.py`); tests and benchmarks pass explicit
    `max_total_tokens` / `max_running_requests`, which are then used as given.
    """

    def __init__(self, server_args: ServerArgs, max_total_tokens: Optional[int] = None,
                 max_running_requests: Optional[int] = None, model_config: Optional[ModelConfig] = None,
                 tp_rank: int = 0, dist_init_method: Optional[str] = None, gpu_id: Optional[int] = None):
        self.server_args = server_args
        self.tp_size, self.tp_rank = server_args.tp_size, tp_rank
        self.device = resolve_device(server_args.device)
        if self.device == "cuda" and (gpu_id is not None or self.tp_size > 1):
            self.device = f"cuda:{tp_rank if gpu_id is None else gpu_id}"
            torch.cuda.set_device(self.device)
        if self.device == "cpu":
            tune_host_allocator()
        self.page_size = server_args.page_size
        torch.manual_seed(server_args.random_seed)
        self.model_config = model_config or ModelConfig.from_server_args(server_args)
        self.dtype = self.model_config.dtype
        cfg = self.model_config
        check_tp_size(cfg, self.tp_size)
        self.num_qo_heads_per_rank = cfg.num_attention_heads // self.tp_size
        self.num_kv_heads_per_rank = num_kv_heads_per_rank(cfg.num_key_value_heads, self.tp_size)
        if self.tp_size > 1:
            init_tp_group(self.tp_size, tp_rank, dist_init_method, self.device)
        self.attention_backend_name = resolve_attention_backend(server_args.attention_backend, self.device, self.dtype)
        pre = read_free_memory(self.device) if max_total_tokens is None else None
        self.model = get_model(self.model_config, server_args.load_format, self.device, server_args.random_seed)
        packed = pack_model_weights(self.model, self.device, self.dtype, server_args.enable_torch_compile,
                                    server_args.torch_compile_max_bs)
        fast_bf16_linears = widens_bf16(self.device, self.dtype) or uses_panel_gemm(self.device, self.dtype)
        warn_slow_cpu_bf16(self.dtype, self.device, fast_weights=packed > 0 and fast_bf16_linears)
        self.kv_budget = self._agree_over_ranks(self._size_kv_pool(pre, max_total_tokens, max_running_requests))
        self.kv_budget.log()
        self.max_req_len = self.kv_budget.max_req_len
        self.max_req_input_len = self.kv_budget.max_req_input_len
        self.max_running_requests = self.kv_budget.max_running_requests
        self.init_memory_pool(self.kv_budget.max_total_num_tokens, self.max_running_requests)
        self.attn_backend = create_attention_backend(self.attention_backend_name, self,
                                                     extend_op=self._cpu_extend_uses_op())
        self.sampler = Sampler()
        self.graph_runner: Optional[CudaGraphRunner] = None
        self.compiled_forward = None
        self.cpu_decode_runner: Optional[CpuDecodeRunner] = None
        self.init_cuda_graphs()
        self.cpu_decode_runner = CpuDecodeRunner.maybe_create(self)

    def _cpu_extend_uses_op(self) -> bool:
        """CPU: whether extend attention runs the C++ op (`cpu_extend_uses_op`), logged when not."""
        if self.device != "cpu" or cpu_extend_uses_op(self.dtype):
            return True
        logger.info("CPU extend attention: torch's SDPA over gathered K/V (%s here: its flash kernel runs on AMX "
                    "tiles; SRT_CPU_EXTEND_ATTENTION=op runs the C++ op reading the KV pool in place).",
                    str(self.dtype).replace("torch.", ""))
        return False

    def init_cuda_graphs(self) -> None:
        """Decode through `CudaGraphRunner`'s captured graphs on CUDA (unless --disable-cuda-graph);
        elsewhere, with --enable-torch-compile, through the compiled eager forward."""
        args = self.server_args
        on_cuda = self.device.startswith("cuda")
        self.compiled_forward = None
        if on_cuda and not args.disable_cuda_graph:
            self.graph_runner = CudaGraphRunner(self)
        elif args.enable_torch_compile:
            self.init_torch_compile()

    def init_torch_compile(self) -> None:
        """torch.compile the eager decode forward (CPU, or CUDA without graphs): dynamic shapes,
        so batch sizes and KV lengths share one compiled graph; used up to --torch-compile-max-bs.
        On CPU inductor freezes the weights (`compile_warmup.py`). The graphs compile here, on a
        dummy batch, rather than in the first requests' decode steps."""
        self.compiled_forward = compile_decode_forward(self.model.forward, self.device)
        warmup_compiled_decode(self)

    def _size_kv_pool(self, pre: Optional[MemoryReading], max_total_tokens: Optional[int],
                      max_running_requests: Optional[int]) -> KVBudget:
        args, cfg = self.server_args, self.model_config
        kind = "cuda" if self.device.startswith("cuda") else "cpu"
        cell = MHATokenToKVPool.cell_size_bytes(self.num_kv_heads_per_rank, cfg.head_dim, cfg.num_hidden_layers,
                                                cfg.kv_cache_dtype)
        if pre is None:
            budget = fixed_kv_budget(max_total_tokens, args.max_running_requests, cell, self.page_size,
                                     cfg.context_len, kind)
        else:
            reserve = graph_reserve_bytes(args, cfg, kind, self.attention_backend_name)
            fraction = args.mem_fraction_static or default_mem_fraction_static(kind, pre.total_bytes, reserve)
            if kind == "cpu" and local_rank_count(args) > 1:
                fraction = cpu_fraction_share(fraction, args)
            avail = free_memory_after_load(self.device, pre, self.model)
            if args.enable_torch_compile:  # taken by the compile at the end of start-up
                avail -= frozen_weight_nbytes(self.model, self.device, self.dtype, args.torch_compile_max_bs)
            logger.debug("Free memory before loading %d bytes (%s), after %d bytes.", pre.free_bytes,
                         pre.source, avail)
            budget = compute_kv_budget(pre.free_bytes, avail, fraction, cell, self.page_size, cfg.context_len,
                                       args.max_total_tokens, args.max_running_requests, kind)
        if max_running_requests is not None:
            bound = f"max_running_requests={max_running_requests} given by the caller"
            budget = dataclasses.replace(budget, max_running_requests=max_running_requests, running_bound=bound)
        return budget

    def _agree_over_ranks(self, budget: KVBudget) -> KVBudget:
        """TP: every rank must admit the same work, so the pool is the minimum over the ranks
        (all-reduced at start-up) and the request limits follow from it."""
        if self.tp_size == 1:
            return budget
        total, running = all_reduce_min_int([budget.max_total_num_tokens, budget.max_running_requests])
        if (total, running) == (budget.max_total_num_tokens, budget.max_running_requests):
            return budget
        cfg = self.model_config
        kind = "cuda" if self.device.startswith("cuda") else "cpu"
        agreed = fixed_kv_budget(total, running, budget.cell_size, self.page_size, cfg.context_len, kind)
        return dataclasses.replace(agreed, total_bound=f"the smallest pool over {self.tp_size} TP ranks "
                                   f"({budget.total_bound} on this rank)")

    def init_memory_pool(self, max_total_tokens: int, max_running_requests: int) -> None:
        P = self.page_size
        T = max_total_tokens // P * P
        if T <= 0:
            raise ValueError(f"KV pool of {max_total_tokens} tokens holds no page of {P} tokens.")
        self.max_total_num_tokens = T
        cfg = self.model_config
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, cfg.context_len + 4, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            T, P, self.dtype, cfg.kv_cache_dtype, self.num_kv_heads_per_rank, cfg.head_dim,
            cfg.num_hidden_layers, self.device,
        )
        if P == 1:
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(T, self.device)
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(T, P, self.device)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        if self.cpu_decode_runner is not None and self.cpu_decode_runner.can_run(fb):
            return self.cpu_decode_runner.forward(fb)
        forward = self.model.forward
        if (self.compiled_forward is not None and fb.forward_mode.is_decode()
                and fb.batch_size <= self.server_args.torch_compile_max_bs):
            forward = self.compiled_forward
        return forward(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def sample(self, logits_output: LogitsProcessorOutput, fb: ForwardBatch, **logprob_kwargs) -> SampleOutput:
        """Choose each request's next token with `fb.sampling_info`; seeded draws are keyed by
        the request's sequence length, so they do not depend on the rest of the batch."""
        out = self.sampler(logits_output.next_token_logits, fb.sampling_info, positions=fb.seq_lens,
                           **logprob_kwargs)
        if self.tp_size > 1:  # the ranks must schedule identically: rank 0's tokens win any tie
            broadcast_tensor(out.next_token_ids, src=0)
        return out
