"""The C++ greedy op (kernels/cpu/csrc/sampling.cpp) against torch.argmax, its oracle: random
rows, ties, NaN, infinities, vector tails, strided rows, bf16; its errors; and the sampler's
greedy path through it."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.elementwise import load_fused_ops
from srt.layers import cpu_fused_ops, sampler
from srt.layers.sampler import Sampler, greedy_ids
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not load_fused_ops(), reason="the C++ CPU kernels cannot build here")
ops = torch.ops.srt_cpu
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (5, 8), (4, 9), (17, 33), (16, 49152), (2, 50257)])
def test_argmax_equals_torch_on_random_rows(dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    got = ops.argmax_rows(logits)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, torch.argmax(logits, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ties_nan_and_infinities_follow_torch(dtype):
    vocab = 37  # four whole vectors and a tail of five (eight lanes), or two and five (sixteen)
    rows = []
    for a, b in [(3, 30), (30, 35), (0, 36), (8, 16), (35, 36)]:  # equal maxima in vectors and tails
        row = torch.zeros(vocab)
        row[a] = row[b] = 7.0
        rows.append(row)
    for positions in [(5,), (33,), (2, 34), (36,)]:  # NaN: the first one wins over any value
        row = torch.arange(vocab, dtype=torch.float32)
        row[list(positions)] = NAN
        rows.append(row)
    rows.append(torch.full((vocab,), -INF))  # all -inf: index 0
    row = torch.full((vocab,), -INF)
    row[35] = INF
    rows.append(row)
    row = torch.full((vocab,), 3.0)
    row[31] = INF
    row[32] = INF
    rows.append(row)
    row = torch.zeros(vocab)
    row[4] = -0.0  # -0.0 == 0.0: the first zero wins
    rows.append(row)
    logits = torch.stack(rows).to(dtype)
    expected = torch.argmax(logits, dim=-1)
    assert torch.equal(ops.argmax_rows(logits), expected)
    assert expected[:5].tolist() == [3, 30, 0, 8, 35]
    assert expected[5:9].tolist() == [5, 33, 2, 36]


def test_strided_rows_and_a_column_slice():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 100, generator=g)
    view = wide[::2, 10:90]  # rows 2 apart, each a contiguous slice
    assert torch.equal(ops.argmax_rows(view), torch.argmax(view, dim=-1))
    transposed = torch.randn(40, 5, generator=g).t()  # vocab not contiguous: copied first
    assert torch.equal(ops.argmax_rows(transposed), torch.argmax(transposed, dim=-1))
    assert ops.argmax_rows(torch.empty(0, 10)).shape == (0,)


def test_bad_input_is_refused_with_what_was_given():
    with pytest.raises(RuntimeError, match=r"logits must be \[rows, vocab\], got \[8\]"):
        ops.argmax_rows(torch.randn(8))
    with pytest.raises(RuntimeError, match="the vocab dim is empty"):
        ops.argmax_rows(torch.empty(3, 0))
    with pytest.raises(RuntimeError, match="fp32 or bf16 logits, got Half"):
        ops.argmax_rows(torch.randn(2, 4).half())


def test_greedy_ids_takes_the_op_on_cpu_and_torch_otherwise(monkeypatch):
    calls = []
    real = ops.argmax_rows

    class Spy:
        def argmax_rows(self, logits):
            calls.append(tuple(logits.shape))
            return real(logits)

    monkeypatch.setattr(sampler, "fused_ops_for", lambda *t: Spy() if cpu_fused_ops.fused_ops_for(*t) else None)
    logits = torch.randn(4, 300)
    assert torch.equal(greedy_ids(logits), torch.argmax(logits, dim=-1))
    assert calls == [(4, 300)]
    half = logits.half()  # not an op dtype: torch's argmax
    assert torch.equal(greedy_ids(half), torch.argmax(half, dim=-1))
    assert calls == [(4, 300)]


def test_sampler_greedy_and_mixed_batches_match_torch_argmax():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1000, generator=g) * 3
    greedy = SamplingBatchInfo.from_params([SamplingParams(temperature=0.0)] * 6, vocab_size=1000,
                                           device="cpu")
    out = Sampler()(logits.clone(), greedy)
    assert torch.equal(out.next_token_ids, torch.argmax(logits, dim=-1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5)] * 3
    mixed = SamplingBatchInfo.from_params(params, vocab_size=1000, device="cpu")
    ids = Sampler()(logits.clone(), mixed).next_token_ids
    assert torch.equal(ids[0::2], torch.argmax(logits[0::2], dim=-1))
    top5 = logits[1::2].topk(5, dim=-1).indices
    assert all(int(i) in row.tolist() for i, row in zip(ids[1::2], top5))
