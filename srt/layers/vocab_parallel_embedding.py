"""Token embedding and LM head split over the vocabulary (SGLang's names).

Rank r holds rows `[r * V/tp, (r + 1) * V/tp)` of the (padded) vocabulary. The embedding looks up
the ids it owns, zeroes the rest and all-reduces; the LM head's logits are all-gathered in
`LogitsProcessor` before sampling, so every rank samples from the same full row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce

PAD_MULTIPLE = 64  # rows per rank are padded to this, as SGLang does


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    step = PAD_MULTIPLE * tp_size
    return vocab_size if tp_size == 1 else -(-vocab_size // step) * step


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.org_vocab_size = num_embeddings
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, self.tp_size)
        self.shard_size = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = self.vocab_start + self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's rows of the checkpoint's [V, hidden]; rows past V (padding) are zeros."""
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.org_vocab_size:
            raise ValueError(f"embedding shape {tuple(loaded.shape)} does not match "
                             f"({self.org_vocab_size}, {param.shape[1]})")
        end = min(self.vocab_end, self.org_vocab_size)
        param.data.zero_()
        if end > self.vocab_start:
            param.data[: end - self.vocab_start].copy_(loaded[self.vocab_start : end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Holds this rank's slice of the output projection; `LogitsProcessor` computes and gathers."""
