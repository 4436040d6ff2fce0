"""`Req` prefix matching: the match cap and packing done once per token."""

from __future__ import annotations

import torch

from managers.req import Req
from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.memory_pool import ReqToTokenPool
from mem_cache.radix_cache import RadixCache
from srt.sampling.sampling_params import SamplingParams


def _tree():
    alloc = TokenToKVPoolAllocator(4096)
    return RadixCache(ReqToTokenPool(4, 512), alloc), alloc


def test_match_is_capped_at_len_minus_one_and_reuses_packing():
    tree, alloc = _tree()
    prompt = list(range(10, 310))
    tree.insert(prompt, alloc.alloc(len(prompt)))
    req = Req("r", prompt, SamplingParams())
    req.init_next_round_input(tree)
    assert len(req.prefix_indices) == len(prompt) - 1  # one token always recomputed
    assert req.extend_input_len == 1
    packed_before = req._radix_key._packed
    req.init_next_round_input(tree)
    assert req._radix_key._packed is packed_before  # nothing repacked on a re-match
    req.output_ids += [5, 6]
    req.init_next_round_input(tree)
    assert req.fill_ids == prompt + [5, 6]
    assert req._radix_key.num_packed >= len(prompt) + 1
    assert req._radix_key._packed.startswith(packed_before)  # extended, not repacked


def test_input_logprobs_cap_and_truncate():
    tree, alloc = _tree()
    prompt = list(range(10, 60))
    tree.insert(prompt, alloc.alloc(len(prompt)))
    req = Req("r", prompt, SamplingParams(), return_logprob=True, logprob_start_len=20)
    req.init_next_round_input(tree)
    assert len(req.prefix_indices) == 20
    short = Req("s", prompt, SamplingParams())
    short.truncate_input(30)
    short.init_next_round_input(tree)
    assert short.truncated_input_len == 50 and len(short.prefix_indices) == 29
    assert torch.equal(short.prefix_indices, req.prefix_indices[:29]) or len(req.prefix_indices) < 29
