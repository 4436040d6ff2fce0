"""`ModelRunner`: owns the model, the KV pools and the attention backend; runs one step."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from kernels.attention import create_attention_backend, resolve_attention_backend
from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.configs.model_config import ModelConfig
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.sampler import SampleOutput, Sampler
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_loader.loader import get_model
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available (torch "
                         f"{torch.__version__}); use --device cpu or auto.")
    return device


class ModelRunner:
    """Loads the model and sizes the pools to `max_total_tokens` KV slots and
    `max_running_requests` request rows of `context_len + 4` columns."""

    def __init__(self, server_args: ServerArgs, max_total_tokens: int, max_running_requests: int,
                 model_config: Optional[ModelConfig] = None):
        self.server_args = server_args
        self.device = resolve_device(server_args.device)
        self.page_size = server_args.page_size
        torch.manual_seed(server_args.random_seed)
        self.model_config = model_config or ModelConfig.from_server_args(server_args)
        self.dtype = self.model_config.dtype
        self.model = get_model(self.model_config, server_args.load_format, self.device, server_args.random_seed)
        self.init_memory_pool(max_total_tokens, max_running_requests)
        self.attention_backend_name = resolve_attention_backend(server_args.attention_backend, self.device, self.dtype)
        self.attn_backend = create_attention_backend(self.attention_backend_name, self)
        self.sampler = Sampler()

    def init_memory_pool(self, max_total_tokens: int, max_running_requests: int) -> None:
        P = self.page_size
        T = max_total_tokens // P * P
        if T <= 0:
            raise ValueError(f"KV pool of {max_total_tokens} tokens holds no page of {P} tokens.")
        self.max_total_num_tokens = T
        cfg = self.model_config
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, cfg.context_len + 4, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            T, P, self.dtype, cfg.kv_cache_dtype, cfg.num_key_value_heads, cfg.head_dim,
            cfg.num_hidden_layers, self.device,
        )
        if P == 1:
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(T, self.device)
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(T, P, self.device)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        self.attn_backend.init_forward_metadata(fb)
        return self.model.forward(fb.input_ids, fb.positions, fb)

    def sample(self, logits_output: LogitsProcessorOutput, fb: ForwardBatch, **logprob_kwargs) -> SampleOutput:
        """Choose each request's next token with `fb.sampling_info`; seeded draws are keyed by
        the request's sequence length, so they do not depend on the rest of the batch."""
        return self.sampler(logits_output.next_token_logits, fb.sampling_info, positions=fb.seq_lens,
                            **logprob_kwargs)
