// Paged decode attention on the CPU. Each request's K/V rows are read where they lie in the KV
// pool, through `req_to_token` (no gathered or padded copy), so the work of a row is its own
// length. Keys are cut into fixed-size splits (flash-decoding): each (request, split) is one task
// with its own online softmax per head, and a request with several splits is merged at the end.
// Splits of several requests over the same slots (a prefix shared through the radix cache) are one
// task, so a shared prefix is read from memory once per step, not once per request.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"
#include "bf16_dot_tiles.h"
#include "cpu_math.h"
#include "decode_plan.h"

namespace {

using srt_cpu::from_float;
using srt_cpu::kBlockTokens;
using srt_cpu::kLanes;
using srt_cpu::vfloat;
using srt_cpu::vload;
using srt_cpu::vstore;
using srt_cpu::vsum;
using srt_cpu_decode::Member;
using srt_cpu_decode::Merge;
using srt_cpu_decode::Plan;
using srt_cpu_decode::Task;
using srt_cpu_decode::plan_decode;

// Per-worker buffers, allocated once per worker per call, with the running state of up to
// `members` queries (q, acc, max, sum, score: member m at offset m * heads), the block's slots,
// its K or V rows of one kv head where they lie in the pool (`float_rows` or `bf16_rows`, by the
// pool's dtype), and that head's K rows transposed (kt, fp32 [dim][kBlockTokens]). The bf16 path
// (Decode::score_block) keeps each query as unscaled bf16 pairs (qb) and the keys transposed by
// pairs (kt_pairs, [dim / 2][kBlockTokens]) instead.
struct Scratch {
  int64_t heads, dim;
  std::vector<float> q, acc, score, max, sum, kt;
  std::vector<int64_t> slot;
  std::vector<const float*> float_rows, q_rows;
  std::vector<const c10::BFloat16*> bf16_rows;
  std::vector<float*> score_rows, acc_rows;
  std::vector<uint32_t> qb, kt_pairs;
  std::vector<const uint32_t*> qb_rows;
  Scratch(int64_t heads, int64_t dim, int64_t members, bool bf16_dot)
      : heads(heads), dim(dim), q(members * heads * dim), acc(members * heads * dim),
        score(members * heads * kBlockTokens), max(members * heads), sum(members * heads),
        kt(bf16_dot ? 0 : dim * kBlockTokens), slot(kBlockTokens), float_rows(kBlockTokens), q_rows(members * heads),
        bf16_rows(kBlockTokens), score_rows(members * heads), acc_rows(members * heads),
        qb(bf16_dot ? members * heads * dim / 2 : 0), kt_pairs(bf16_dot ? dim / 2 * kBlockTokens : 0),
        qb_rows(members * heads) {}
};

// Member m's view of the running state in a Scratch.
struct Query {
  float *q, *acc, *score, *max, *sum;
  Query(Scratch& s, int64_t m)
      : q(s.q.data() + m * s.heads * s.dim), acc(s.acc.data() + m * s.heads * s.dim),
        score(s.score.data() + m * s.heads * kBlockTokens), max(s.max.data() + m * s.heads),
        sum(s.sum.data() + m * s.heads) {}
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

  // Whether score_block's bf16 dot products serve this call: bf16 queries and KV, whole 32-element pairs of the head
  // dim, and a CPU with AVX512-BF16 (the build's -march=native decides).
  bool bf16_dot() const {
#if defined(SRT_CPU_BF16_DOT)
    return std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<kv_t, c10::BFloat16> && dim % 32 == 0;
#else
    return false;
#endif
  }

  void load_q(int64_t b, const Query& m) const {
    for (int64_t h = 0; h < heads(); ++h) {
      const q_t* src = q + b * q_s0 + h * q_s1;
      float* dst = m.q + h * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = srt_cpu::to_float(src[d]) * scale;
    }
    std::fill(m.acc, m.acc + heads() * dim, 0.0f);
    std::fill(m.max, m.max + heads(), -std::numeric_limits<float>::infinity());
    std::fill(m.sum, m.sum + heads(), 0.0f);
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

  // Read one byte of every cache line of the K and V rows (every kv head's elements, as far as
  // the last head's end) of the keys [first, first + kBlockTokens) of `slots`, clipped at `end`:
  // the block after the one being computed, so that its rows come from memory while this one is.
  // Plain loads, not prefetch instructions: on an AVX2-only Zen 3 (a VM, 4 KiB pages) software
  // prefetches of the next block, into L1 or L2, one or two blocks ahead, changed nothing
  // (0.96-1.01x), where these loads made the op 1.26-1.37x (fp32) and 1.53-1.55x (bf16) as fast
  // at 16 x 410 and 16 x 1,100 tokens with the rows in memory, 30 layers in turn (a prefetch whose
  // page is not in the TLB may be dropped; a load walks the page table). Rows already in the
  // caches pay for the loads (0.80-0.83x with one layer's rows in L3), which a decode step, whose
  // weights pass through the caches between two layers' attention, does not meet.
  void touch_rows(const int32_t* slots, int64_t first, int64_t end) const {
    const int64_t k_bytes = ((num_kv_heads - 1) * k_s1 + dim) * static_cast<int64_t>(sizeof(kv_t));
    const int64_t v_bytes = ((num_kv_heads - 1) * v_s1 + dim) * static_cast<int64_t>(sizeof(kv_t));
    for (int64_t j = first; j < std::min(first + kBlockTokens, end); ++j) {
      const int64_t slot = slots[j];
      if (slot < 0 || slot >= num_slots) continue;  // lookup_slots flags it
      const volatile char* k_row = reinterpret_cast<const volatile char*>(k + slot * k_s0);
      const volatile char* v_row = reinterpret_cast<const volatile char*>(v + slot * v_s0);
      for (int64_t b = 0; b < k_bytes; b += 64) static_cast<void>(k_row[b]);
      for (int64_t b = 0; b < v_bytes; b += 64) static_cast<void>(v_row[b]);
    }
  }

  // Key j's row of kv head `kv_head` in `buffer` (k or v), where it lies in the pool, for the
  // block's n keys. Read in place: a copy of the block's rows (as fp32) cost more than it saved,
  // 1.08-1.16x on 16 x 300 tokens in turns with it, contiguous or shuffled slots, fp32 and bf16.
  const kv_t* const* pool_rows(const kv_t* buffer, int64_t s0, int64_t s1, int64_t kv_head, int64_t n,
                               Scratch& s) const {
    const kv_t** out;
    if constexpr (std::is_same_v<kv_t, float>) {
      out = s.float_rows.data();
    } else {
      out = s.bf16_rows.data();
    }
    for (int64_t j = 0; j < n; ++j) out[j] = buffer + s.slot[j] * s0 + kv_head * s1;
    return out;
  }

  // Online softmax of each head of kv head h0's group over the block's n keys (attention_tiles.h).
  void softmax_block(int64_t h0, int64_t n, const Query& m) const {
    for (int64_t h = h0; h < h0 + group; ++h)
      srt_cpu::softmax_block(m.score + h * kBlockTokens, m.acc + h * dim, m.max[h], m.sum[h], n, dim);
  }

  // The query rows of one kv head, over every member: row r is member r / group's head
  // h0 + r % group (its q, its block scores, its running output).
  int64_t point_queries(int64_t h0, int64_t count, Scratch& s) const {
    int64_t r = 0;
    for (int64_t i = 0; i < count; ++i) {
      const Query m(s, i);
      for (int64_t h = h0; h < h0 + group; ++h, ++r) {
        s.q_rows[r] = m.q + h * dim;
        s.score_rows[r] = m.score + h * kBlockTokens;
        s.acc_rows[r] = m.acc + h * dim;
      }
    }
    return r;
  }

  // With `bf16_dot` (bf16 queries and KV, see bf16_dot()), each member's queries are also kept
  // as unscaled bf16 pairs for score_block.
  void run(const Task& t, const Member* members, Scratch& s, bool bf16_dot) const {
    for (int64_t i = 0; i < t.count; ++i) {
      load_q(members[i].b, Query(s, i));
      if (bf16_dot) {
        for (int64_t h = 0; h < heads(); ++h) {
          std::memcpy(s.qb.data() + (i * heads() + h) * (dim / 2), q + members[i].b * q_s0 + h * q_s1,
                      dim * sizeof(q_t));
        }
      }
    }
    // Every member's slots in [begin, end) are the same: read them through the first one's row.
    const int32_t* slots = req_to_token + rows[members[0].b] * r2t_s0;
    touch_rows(slots, t.begin, t.end);
    for (int64_t start = t.begin; start < t.end; start += kBlockTokens) {
      const int64_t n = std::min(kBlockTokens, t.end - start);
      touch_rows(slots, start + kBlockTokens, t.end);
      lookup_slots(slots, start, n, s);
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        const int64_t h0 = kv_head * group;
        const int64_t query_rows = point_queries(h0, t.count, s);
        score_block(kv_head, query_rows, n, s, bf16_dot);
        for (int64_t i = 0; i < t.count; ++i) softmax_block(h0, n, Query(s, i));
        srt_cpu::value_rows(s.score_rows.data(), pool_rows(v, v_s0, v_s1, kv_head, n, s), s.acc_rows.data(),
                            query_rows, n, dim);
      }
    }
    for (int64_t i = 0; i < t.count; ++i) finish(members[i], Query(s, i));
  }

  // The block's scores of kv head `kv_head`'s query rows. With AVX-512 or AVX2 + FMA and a head
  // dim of whole vectors, the scaled fp32 queries against the K rows in place, fp32 or bf16
  // widened as they are read (score_rows_direct); else the K rows transposed as fp32 tiles first.
  // bf16 dot: the K rows transposed by pairs of the head dim (half the bytes) and scored with
  // vdpbf16ps against the bf16 queries, the scale applied to the fp32 dot product (bf16_dot_tiles.h).
  void score_block(int64_t kv_head, int64_t query_rows, int64_t n, Scratch& s, bool bf16_dot) const {
#if defined(SRT_CPU_BF16_DOT)
    if constexpr (std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<kv_t, c10::BFloat16>) {
      if (bf16_dot) {
        const int64_t pairs = dim / 2, h0 = kv_head * group;
        for (int64_t r = 0; r < query_rows; ++r) {
          s.qb_rows[r] = s.qb.data() + ((r / group) * heads() + h0 + r % group) * pairs;
        }
        srt_cpu::transpose_key_pairs(pool_rows(k, k_s0, k_s1, kv_head, n, s), n, dim, s.kt_pairs.data());
        srt_cpu::score_rows_bf16(s.qb_rows.data(), s.kt_pairs.data(), s.score_rows.data(), query_rows, pairs, scale);
        return;
      }
    }
#endif
#if defined(SRT_CPU_DIRECT_SCORES)
    // A decode task has few query rows per kv head (its group, times its members): scoring the
    // K rows in place beats transposing each block first (1.04-1.06x the op, 16 x 300 fp32, on
    // AVX-512; 1.11-1.17x on an AVX2-only Zen 3 at 16 x 270 and 16 x 1100 tokens, one thread).
    if (dim % srt_cpu::kDirectScoreDim == 0 && (std::is_same_v<kv_t, float> || srt_cpu::kDirectScoresBf16)) {
      srt_cpu::score_rows_direct(s.q_rows.data(), pool_rows(k, k_s0, k_s1, kv_head, n, s), s.score_rows.data(),
                                 query_rows, n, dim);
      return;
    }
#endif
    srt_cpu::transpose_keys(pool_rows(k, k_s0, k_s1, kv_head, n, s), n, dim, s.kt.data());
    srt_cpu::score_rows(s.q_rows.data(), s.kt.data(), s.score_rows.data(), query_rows, dim);
  }

  // A member's output (one split) or its partial (several).
  void finish(const Member& member, const Query& m) const {
    for (int64_t h = 0; h < heads(); ++h) {
      const float* acc = m.acc + h * dim;
      if (member.part < 0) {
        q_t* dst = out + (member.b * heads() + h) * dim;
        const float inv = 1.0f / m.sum[h];
        for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<q_t>(acc[d] * inv);
      } else {
        const int64_t p = member.part * heads() + h;
        std::memcpy(part_acc + p * dim, acc, dim * sizeof(float));
        part_max[p] = m.max[h];
        part_sum[p] = m.sum[h];
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

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// The table half of the inputs: which rows of req_to_token, and how many of their slots, a batch
// of `batch` requests reads.
void check_table(const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& lens, int64_t batch) {
  for (const at::Tensor* t : {&req_to_token, &rows, &lens}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention takes CPU tensors only, got ", t->device());
  }
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token must be a 2-D int32 table with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "req_pool_indices and seq_lens must be int64");
  TORCH_CHECK(rows.dim() == 1 && lens.dim() == 1 && rows.size(0) == batch && lens.size(0) == batch,
              "req_pool_indices and seq_lens must be [batch] with batch = ", batch);
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* n = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(r[b] >= 0 && r[b] < req_to_token.size(0), "req_pool_indices[", b, "] = ", r[b], " is not a row");
    TORCH_CHECK(n[b] >= 1 && n[b] <= req_to_token.size(1), "seq_lens[", b, "] = ", n[b], " outside [1, ",
                req_to_token.size(1), "]");
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& req_to_token,
                  const at::Tensor& rows, const at::Tensor& lens) {
  for (const at::Tensor* t : {&q, &k, &v}) {
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
  check_table(req_to_token, rows, lens, q.size(0));
}

template <typename q_t, typename kv_t>
void run_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& req_to_token,
                const at::Tensor& rows, double scale, const Plan& plan, bool allow_bf16_dot, at::Tensor& out) {
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

  const bool bf16_dot = allow_bf16_dot && op.bf16_dot();
  srt_cpu::parallel_tasks<Scratch>(
      static_cast<int64_t>(plan.tasks.size()),
      [&] { return Scratch(q.size(1), dim, plan.max_members, bf16_dot); },
      [&](int64_t i, Scratch& s) { op.run(plan.tasks[i], plan.members.data() + plan.tasks[i].first, s, bf16_dot); });
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
// `bf16_dot`: bf16 q and KV are scored with bf16 dot products (Decode::score_block) where the
// build has AVX512-BF16 (False: the fp32 tiles, for comparisons).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, double scale, bool share_prefixes, bool bf16_dot) {
  const at::Tensor rows = req_pool_indices.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  check_inputs(q, k_buffer, v_buffer, req_to_token, rows, lens);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const Plan plan = plan_decode(lens.data_ptr<int64_t>(), q.size(0), req_to_token.data_ptr<int32_t>(),
                                req_to_token.stride(0), rows.data_ptr<int64_t>(), share_prefixes);
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const bool kv_bf16 = k_buffer.scalar_type() == at::kBFloat16;
  if (q_bf16 && kv_bf16) {
    run_decode<c10::BFloat16, c10::BFloat16>(q, k_buffer, v_buffer, req_to_token, rows, scale, plan, bf16_dot, out);
  } else if (q_bf16) {
    run_decode<c10::BFloat16, float>(q, k_buffer, v_buffer, req_to_token, rows, scale, plan, bf16_dot, out);
  } else if (kv_bf16) {
    run_decode<float, c10::BFloat16>(q, k_buffer, v_buffer, req_to_token, rows, scale, plan, bf16_dot, out);
  } else {
    run_decode<float, float>(q, k_buffer, v_buffer, req_to_token, rows, scale, plan, bf16_dot, out);
  }
  return out;
}

// The members of each task paged_decode_attention would run for this batch, largest task first:
// what the tests and the benchmark read to see which splits are shared.
at::Tensor paged_decode_task_members(const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                     const at::Tensor& seq_lens, bool share_prefixes) {
  const at::Tensor rows = req_pool_indices.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  check_table(req_to_token, rows, lens, rows.size(0));
  const Plan plan = plan_decode(lens.data_ptr<int64_t>(), rows.size(0), req_to_token.data_ptr<int32_t>(),
                                req_to_token.stride(0), rows.data_ptr<int64_t>(), share_prefixes);
  at::Tensor counts = at::empty({static_cast<int64_t>(plan.tasks.size())}, rows.options());
  for (size_t i = 0; i < plan.tasks.size(); ++i) counts.data_ptr<int64_t>()[i] = plan.tasks[i].count;
  return counts;
}

TORCH_LIBRARY(srt_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor seq_lens, float scale, bool share_prefixes=True, bool bf16_dot=True) -> Tensor");
  m.def(
      "paged_decode_task_members(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
      "bool share_prefixes=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_task_members", &paged_decode_task_members);
}
