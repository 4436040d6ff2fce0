// Paged decode attention on the CPU. Each request's K/V rows are read where they lie in the KV
// pool, through `req_to_token` (no gathered or padded copy), so the work of a row is its own
// length. Keys are cut into fixed-size splits (flash-decoding): each (request, split) is one task
// with its own online softmax per head, and a request with several splits is merged at the end.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace {

using srt_cpu::float_row;
using srt_cpu::from_float;
using srt_cpu::kLanes;
using srt_cpu::vfloat;
using srt_cpu::vload;
using srt_cpu::vstore;
using srt_cpu::vsum;

// Keys per task: equal-sized work items balance ragged rows over the threads. Fixed (not derived
// from the thread count) so a row's result never depends on the machine or the rest of the batch.
constexpr int64_t kSplitTokens = 256;
// Keys scored together before one rescale of the running output.
constexpr int64_t kBlockTokens = 32;
static_assert(kBlockTokens % kLanes == 0, "score rows are processed in whole vectors");

// One unit of work: keys [begin, end) of request `b`, every head. All heads in one task, so the
// K and V rows of a slot ([kv_heads, head_dim], contiguous) are read together. `part` < 0: the
// request has one split and the task writes the output itself; otherwise the index of its
// (max, sum, unnormalised output) partial.
struct Task {
  int64_t b, begin, end, part;
};

// A request whose splits are merged: partials [first, first + count).
struct Merge {
  int64_t b, first, count;
};

// Per-worker buffers, allocated once per worker per call. `rows[j]` points at key j's K (then
// V) row of one kv head as fp32: in the pool itself for fp32 storage, in `tile` for bf16.
struct Scratch {
  std::vector<float> q, acc, score, tile, max, sum;
  std::vector<int64_t> slot;
  std::vector<const float*> rows;
  Scratch(int64_t heads, int64_t dim)
      : q(heads * dim), acc(heads * dim), score(heads * kBlockTokens), tile(kBlockTokens * dim), max(heads),
        sum(heads), slot(kBlockTokens), rows(kBlockTokens) {}
};

template <typename q_t, typename kv_t>
struct Decode {
  const q_t* q;
  int64_t q_s0, q_s1;
  q_t* out;  // contiguous [bs, heads, dim]
  const kv_t* k;
  const kv_t* v;
  int64_t k_s0, k_s1, v_s0, v_s1, num_slots;
  const int32_t* req_to_token;
  int64_t r2t_s0;
  const int64_t* rows;
  int64_t num_kv_heads, group, dim;
  float scale;
  float* part_acc;  // [parts, heads, dim]
  float* part_max;  // [parts, heads]
  float* part_sum;  // [parts, heads]
  std::atomic<bool>* bad_slot;

  int64_t heads() const { return num_kv_heads * group; }

  void load_q(int64_t b, Scratch& s) const {
    for (int64_t h = 0; h < heads(); ++h) {
      const q_t* src = q + b * q_s0 + h * q_s1;
      float* dst = s.q.data() + h * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = srt_cpu::to_float(src[d]) * scale;
    }
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    std::fill(s.max.begin(), s.max.end(), -std::numeric_limits<float>::infinity());
    std::fill(s.sum.begin(), s.sum.end(), 0.0f);
  }

  void lookup_slots(const int32_t* slots, int64_t start, int64_t n, Scratch& s) const {
    for (int64_t j = 0; j < n; ++j) {
      int64_t slot = slots[start + j];
      if (slot < 0 || slot >= num_slots) {
        bad_slot->store(true, std::memory_order_relaxed);
        slot = 0;  // the zeroed dummy slot: keeps going, the op raises after the loop
      }
      s.slot[j] = slot;
    }
  }

  void point_rows(const kv_t* buffer, int64_t s0, int64_t head_offset, int64_t n, Scratch& s) const {
    for (int64_t j = 0; j < n; ++j) {
      s.rows[j] = float_row(buffer + s.slot[j] * s0 + head_offset, s.tile.data() + j * dim, dim);
    }
  }

  // s.score[h][j] = q_h . k_j for the heads [h0, h0 + group) of one kv head, four keys at a time
  // (four independent accumulators).
  void score_block(int64_t h0, int64_t n, Scratch& s) const {
    const float* const* key = s.rows.data();
    const int64_t vec_dim = dim / kLanes * kLanes;
    for (int64_t h = h0; h < h0 + group; ++h) {
      const float* qh = s.q.data() + h * dim;
      float* score = s.score.data() + h * kBlockTokens;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        const float *k0 = key[j], *k1 = key[j + 1], *k2 = key[j + 2], *k3 = key[j + 3];
        vfloat a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int64_t d = 0; d < vec_dim; d += kLanes) {
          const vfloat x = vload(qh + d);
          a0 += x * vload(k0 + d);
          a1 += x * vload(k1 + d);
          a2 += x * vload(k2 + d);
          a3 += x * vload(k3 + d);
        }
        float d0 = vsum(a0), d1 = vsum(a1), d2 = vsum(a2), d3 = vsum(a3);
        for (int64_t d = vec_dim; d < dim; ++d) {
          d0 += qh[d] * k0[d];
          d1 += qh[d] * k1[d];
          d2 += qh[d] * k2[d];
          d3 += qh[d] * k3[d];
        }
        score[j] = d0;
        score[j + 1] = d1;
        score[j + 2] = d2;
        score[j + 3] = d3;
      }
      for (; j < n; ++j) {
        const float* kj = key[j];
        vfloat a = {};
        for (int64_t d = 0; d < vec_dim; d += kLanes) a += vload(qh + d) * vload(kj + d);
        float dot = vsum(a);
        for (int64_t d = vec_dim; d < dim; ++d) dot += qh[d] * kj[d];
        score[j] = dot;
      }
    }
  }

  // Online softmax: fold the block's scores into each head's running max and sum, rescale
  // the running output, and leave the block's probabilities (relative to the new max) in s.score.
  void softmax_block(int64_t h0, int64_t n, Scratch& s) const {
    for (int64_t h = h0; h < h0 + group; ++h) {
      float* sc = s.score.data() + h * kBlockTokens;
      float block_max = sc[0];
      for (int64_t j = 1; j < n; ++j) block_max = std::max(block_max, sc[j]);
      const float new_max = std::max(s.max[h], block_max);
      const float alpha = std::exp(s.max[h] - new_max);  // 0 on the first block (max is -inf)
      // Whole vectors (a score row is a multiple of kLanes long): lanes past n are never read.
      const vfloat shift = srt_cpu::vbroadcast(new_max);
      for (int64_t j = 0; j < n; j += kLanes) vstore(sc + j, srt_cpu::vexp(vload(sc + j) - shift));
      float block_sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) block_sum += sc[j];
      s.sum[h] = s.sum[h] * alpha + block_sum;
      s.max[h] = new_max;
      if (alpha != 1.0f) {
        float* acc = s.acc.data() + h * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] *= alpha;
      }
    }
  }

  // acc_h += sum_j p_hj * v_j, 32 floats of the head dim at a time: that chunk of the running
  // output stays in four vector registers across the block's keys.
  void accumulate_values(int64_t h0, int64_t n, Scratch& s) const {
    const float* const* value = s.rows.data();
    for (int64_t h = h0; h < h0 + group; ++h) {
      const float* p = s.score.data() + h * kBlockTokens;
      float* acc = s.acc.data() + h * dim;
      int64_t d0 = 0;
      for (; d0 + 4 * kLanes <= dim; d0 += 4 * kLanes) {
        vfloat a0 = vload(acc + d0), a1 = vload(acc + d0 + kLanes);
        vfloat a2 = vload(acc + d0 + 2 * kLanes), a3 = vload(acc + d0 + 3 * kLanes);
        for (int64_t j = 0; j < n; ++j) {
          const float pj = p[j];
          const float* vj = value[j] + d0;
          a0 += pj * vload(vj);
          a1 += pj * vload(vj + kLanes);
          a2 += pj * vload(vj + 2 * kLanes);
          a3 += pj * vload(vj + 3 * kLanes);
        }
        vstore(acc + d0, a0);
        vstore(acc + d0 + kLanes, a1);
        vstore(acc + d0 + 2 * kLanes, a2);
        vstore(acc + d0 + 3 * kLanes, a3);
      }
      for (; d0 + kLanes <= dim; d0 += kLanes) {
        vfloat a = vload(acc + d0);
        for (int64_t j = 0; j < n; ++j) a += p[j] * vload(value[j] + d0);
        vstore(acc + d0, a);
      }
      for (; d0 < dim; ++d0) {
        float a = acc[d0];
        for (int64_t j = 0; j < n; ++j) a += p[j] * value[j][d0];
        acc[d0] = a;
      }
    }
  }

  void run(const Task& t, Scratch& s) const {
    load_q(t.b, s);
    const int32_t* slots = req_to_token + rows[t.b] * r2t_s0;
    for (int64_t start = t.begin; start < t.end; start += kBlockTokens) {
      const int64_t n = std::min(kBlockTokens, t.end - start);
      lookup_slots(slots, start, n, s);
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        const int64_t h0 = kv_head * group;
        point_rows(k, k_s0, kv_head * k_s1, n, s);
        score_block(h0, n, s);
        softmax_block(h0, n, s);
        point_rows(v, v_s0, kv_head * v_s1, n, s);
        accumulate_values(h0, n, s);
      }
    }
    for (int64_t h = 0; h < heads(); ++h) {
      const float* acc = s.acc.data() + h * dim;
      if (t.part < 0) {
        q_t* dst = out + (t.b * heads() + h) * dim;
        const float inv = 1.0f / s.sum[h];
        for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<q_t>(acc[d] * inv);
      } else {
        const int64_t p = t.part * heads() + h;
        std::memcpy(part_acc + p * dim, acc, dim * sizeof(float));
        part_max[p] = s.max[h];
        part_sum[p] = s.sum[h];
      }
    }
  }

  // Merge the splits of one request: weight each partial by exp(its max - the overall max).
  void merge(const Merge& m, std::vector<float>& weight, std::vector<float>& acc) const {
    for (int64_t h = 0; h < heads(); ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < m.count; ++i) top = std::max(top, part_max[(m.first + i) * heads() + h]);
      float total = 0.0f;
      for (int64_t i = 0; i < m.count; ++i) {
        const int64_t p = (m.first + i) * heads() + h;
        weight[i] = std::exp(part_max[p] - top);
        total += weight[i] * part_sum[p];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i = 0; i < m.count; ++i) {
        const float* src = part_acc + ((m.first + i) * heads() + h) * dim;
        const float w = weight[i] / total;
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * src[d];
      }
      q_t* dst = out + (m.b * heads() + h) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<q_t>(acc[d]);
    }
  }
};

struct Plan {
  std::vector<Task> tasks;
  std::vector<Merge> merges;
  int64_t parts = 0;       // partials needed by requests with several splits
  int64_t max_splits = 1;  // the most splits of one request
};

Plan plan_decode(const int64_t* lens, int64_t bs) {
  Plan plan;
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t len = lens[b];
    const int64_t splits = (len + kSplitTokens - 1) / kSplitTokens;
    plan.max_splits = std::max(plan.max_splits, splits);
    const int64_t first = splits > 1 ? plan.parts : -1;
    if (splits > 1) {
      plan.merges.push_back({b, first, splits});
      plan.parts += splits;
    }
    for (int64_t i = 0; i < splits; ++i) {
      const int64_t end = std::min(len, (i + 1) * kSplitTokens);
      plan.tasks.push_back({b, i * kSplitTokens, end, splits > 1 ? first + i : -1});
    }
  }
  return plan;
}

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& req_to_token,
                  const at::Tensor& rows, const at::Tensor& lens) {
  for (const at::Tensor* t : {&q, &k, &v, &req_to_token, &rows, &lens}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention takes CPU tensors only, got ", t->device());
  }
  TORCH_CHECK(q.dim() == 3, "q must be [batch, heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(),
              "k_buffer and v_buffer must both be [slots, kv_heads, head_dim], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.size(2) == k.size(2), "q head_dim ", q.size(2), " != KV head_dim ", k.size(2));
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "q heads ", q.size(1), " not a multiple of kv heads ", k.size(1));
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "the head_dim axis must be contiguous");
  TORCH_CHECK(is_float_or_bf16(q) && is_float_or_bf16(k), "q and KV must be float32 or bfloat16, got ",
              q.scalar_type(), " and ", k.scalar_type());
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k_buffer and v_buffer dtypes differ");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token must be a 2-D int32 table with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "req_pool_indices and seq_lens must be int64");
  TORCH_CHECK(rows.dim() == 1 && lens.dim() == 1 && rows.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "req_pool_indices and seq_lens must be [batch] with batch = ", q.size(0));
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* n = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(r[b] >= 0 && r[b] < req_to_token.size(0), "req_pool_indices[", b, "] = ", r[b], " is not a row");
    TORCH_CHECK(n[b] >= 1 && n[b] <= req_to_token.size(1), "seq_lens[", b, "] = ", n[b], " outside [1, ",
                req_to_token.size(1), "]");
  }
}

template <typename q_t, typename kv_t>
void run_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& req_to_token,
                const at::Tensor& rows, double scale, const Plan& plan, at::Tensor& out) {
  const int64_t num_kv_heads = k.size(1), group = q.size(1) / k.size(1), dim = q.size(2);
  at::Tensor part_acc = at::empty({plan.parts, q.size(1), dim}, q.options().dtype(at::kFloat));
  at::Tensor part_max = at::empty({plan.parts, q.size(1)}, part_acc.options());
  at::Tensor part_sum = at::empty({plan.parts, q.size(1)}, part_acc.options());
  std::atomic<bool> bad_slot{false};
  Decode<q_t, kv_t> op;
  op.q = q.data_ptr<q_t>();
  op.q_s0 = q.stride(0);
  op.q_s1 = q.stride(1);
  op.out = out.data_ptr<q_t>();
  op.k = k.data_ptr<kv_t>();
  op.v = v.data_ptr<kv_t>();
  op.k_s0 = k.stride(0);
  op.k_s1 = k.stride(1);
  op.v_s0 = v.stride(0);
  op.v_s1 = v.stride(1);
  op.num_slots = k.size(0);
  op.req_to_token = req_to_token.data_ptr<int32_t>();
  op.r2t_s0 = req_to_token.stride(0);
  op.rows = rows.data_ptr<int64_t>();
  op.num_kv_heads = num_kv_heads;
  op.group = group;
  op.dim = dim;
  op.scale = static_cast<float>(scale);
  op.part_acc = part_acc.data_ptr<float>();
  op.part_max = part_max.data_ptr<float>();
  op.part_sum = part_sum.data_ptr<float>();
  op.bad_slot = &bad_slot;

  srt_cpu::parallel_tasks<Scratch>(
      static_cast<int64_t>(plan.tasks.size()), [&] { return Scratch(q.size(1), dim); },
      [&](int64_t i, Scratch& s) { op.run(plan.tasks[i], s); });
  using MergeState = std::pair<std::vector<float>, std::vector<float>>;
  srt_cpu::parallel_tasks<MergeState>(
      static_cast<int64_t>(plan.merges.size()),
      [&] { return MergeState(std::vector<float>(plan.max_splits), std::vector<float>(dim)); },
      [&](int64_t i, MergeState& s) { op.merge(plan.merges[i], s.first, s.second); });
  TORCH_CHECK(!bad_slot.load(), "req_to_token holds a KV slot outside the pool of ", k.size(0), " slots");
}

}  // namespace

// q [batch, heads, head_dim] attends, per request b, to the KV slots req_to_token[rows[b], :lens[b]]
// of k_buffer / v_buffer [slots, kv_heads, head_dim]. Returns [batch, heads, head_dim] in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, double scale) {
  const at::Tensor rows = req_pool_indices.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  check_inputs(q, k_buffer, v_buffer, req_to_token, rows, lens);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const Plan plan = plan_decode(lens.data_ptr<int64_t>(), q.size(0));
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const bool kv_bf16 = k_buffer.scalar_type() == at::kBFloat16;
  if (q_bf16 && kv_bf16) {
    run_decode<c10::BFloat16, c10::BFloat16>(q, k_buffer, v_buffer, req_to_token, rows, scale, plan, out);
  } else if (q_bf16) {
    run_decode<c10::BFloat16, float>(q, k_buffer, v_buffer, req_to_token, rows, scale, plan, out);
  } else if (kv_bf16) {
    run_decode<float, c10::BFloat16>(q, k_buffer, v_buffer, req_to_token, rows, scale, plan, out);
  } else {
    run_decode<float, float>(q, k_buffer, v_buffer, req_to_token, rows, scale, plan, out);
  }
  return out;
}

TORCH_LIBRARY(srt_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
