// Paged extend attention on the CPU: each request's new tokens attend causally to its cached
// prefix and to themselves, reading K/V where they lie in the KV pool through `req_to_token`
// (the new tokens' K/V are written there before the call). No gathered copy of the prefix, no
// boolean mask: a query row stops at its own position. One task is a block of one request's new
// tokens with every head, so each block of K/V rows is read once for all the heads.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"
#include "cpu_math.h"

namespace {

using srt_cpu::kBlockTokens;

// New tokens per task: a transposed K block serves 64 x group query rows (16 was slower and 32
// about the same on one thread); a batch of requests spreads over the threads, as does a long prefill.
constexpr int64_t kQueryTokens = 64;
// Request b's new tokens [t0, t1).
struct Task {
  int64_t b, t0, t1;
};

// Per-worker state: the task's queries (scaled, fp32, [tokens][heads][dim]), running outputs,
// maxima, sums and one block's scores per query row; one kv head's K block transposed
// ([dim][kBlockTokens], zero past the block's keys); the block's V rows of that head.
template <typename kv_t>
struct Scratch {
  std::vector<float> q, acc, max, sum, score, kt, v_tile;
  std::vector<int64_t> slot;
  std::vector<const float*> q_rows, v_rows;
  std::vector<const kv_t*> k_rows;
  std::vector<float*> score_rows, acc_rows;
  Scratch(int64_t heads, int64_t dim)
      : q(kQueryTokens * heads * dim), acc(kQueryTokens * heads * dim), max(kQueryTokens * heads),
        sum(kQueryTokens * heads), score(kQueryTokens * heads * kBlockTokens), kt(dim * kBlockTokens),
        v_tile(kBlockTokens * dim), slot(kBlockTokens), q_rows(kQueryTokens * heads), v_rows(kBlockTokens), k_rows(kBlockTokens),
        score_rows(kQueryTokens * heads), acc_rows(kQueryTokens * heads) {}
};

template <typename q_t, typename kv_t>
struct Extend {
  const q_t* q;
  int64_t q_s0, q_s1;
  q_t* out;  // contiguous [tokens, heads, dim]
  const kv_t* k;
  const kv_t* v;
  int64_t k_s0, k_s1, v_s0, v_s1, num_slots;
  const int32_t* req_to_token;
  int64_t r2t_s0;
  const int64_t *rows, *prefix, *start;  // per request: table row, cached prefix, first new token in q
  int64_t num_kv_heads, group, dim;
  float scale;
  std::atomic<bool>* bad_slot;

  int64_t heads() const { return num_kv_heads * group; }

  void load_q(const Task& t, Scratch<kv_t>& s) const {
    const int64_t n = (t.t1 - t.t0) * heads();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t token = start[t.b] + t.t0 + i / heads(), h = i % heads();
      const q_t* src = q + token * q_s0 + h * q_s1;
      float* dst = s.q.data() + i * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = srt_cpu::to_float(src[d]) * scale;
    }
    std::fill(s.acc.begin(), s.acc.begin() + n * dim, 0.0f);
    std::fill(s.max.begin(), s.max.begin() + n, -std::numeric_limits<float>::infinity());
    std::fill(s.sum.begin(), s.sum.begin() + n, 0.0f);
  }

  void lookup_slots(const int32_t* slots, int64_t first, int64_t n, Scratch<kv_t>& s) const {
    for (int64_t j = 0; j < n; ++j) {
      int64_t slot = slots[first + j];
      if (slot < 0 || slot >= num_slots) {
        bad_slot->store(true, std::memory_order_relaxed);
        slot = 0;  // the zeroed dummy slot: keeps going, the op raises after the loop
      }
      s.slot[j] = slot;
    }
  }

  // kv head h's K rows of the block, transposed into s.kt (keys past n are zero), and its V rows:
  // pointers into the pool for fp32, widened into s.v_tile for bf16.
  void load_block(int64_t h, int64_t n, Scratch<kv_t>& s) const {
    for (int64_t j = 0; j < n; ++j) s.k_rows[j] = k + s.slot[j] * k_s0 + h * k_s1;
    srt_cpu::transpose_keys(s.k_rows.data(), n, dim, s.kt.data());
    for (int64_t j = 0; j < n; ++j) {
      const kv_t* src = v + s.slot[j] * v_s0 + h * v_s1;
      if constexpr (std::is_same_v<kv_t, float>) {
        s.v_rows[j] = src;
      } else {
        srt_cpu::load_row(src, s.v_tile.data() + j * dim, dim);
        s.v_rows[j] = s.v_tile.data() + j * dim;
      }
    }
  }

  // Query rows of kv head h from token `first` of the task on: row r is token first + r / group,
  // head h * group + r % group.
  int64_t point_rows(int64_t h, int64_t first, int64_t tokens, Scratch<kv_t>& s) const {
    int64_t r = 0;
    for (int64_t t = first; t < tokens; ++t) {
      for (int64_t g = 0; g < group; ++g, ++r) {
        const int64_t i = t * heads() + h * group + g;
        s.q_rows[r] = s.q.data() + i * dim;
        s.score_rows[r] = s.score.data() + i * kBlockTokens;
        s.acc_rows[r] = s.acc.data() + i * dim;
      }
    }
    return r;
  }

  void run(const Task& t, Scratch<kv_t>& s) const {
    load_q(t, s);
    const int64_t tokens = t.t1 - t.t0;
    const int64_t first_pos = prefix[t.b] + t.t0;  // position of the task's first token
    const int64_t keys = first_pos + tokens;        // the last token sees keys [0, keys)
    const int32_t* slots = req_to_token + rows[t.b] * r2t_s0;
    for (int64_t begin = 0; begin < keys; begin += kBlockTokens) {
      const int64_t n = std::min(kBlockTokens, keys - begin);
      // Tokens before `active` see none of this block's keys.
      const int64_t active = std::max<int64_t>(0, begin - first_pos);
      lookup_slots(slots, begin, n, s);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        load_block(h, n, s);
        const int64_t count = point_rows(h, active, tokens, s);
        srt_cpu::score_rows(s.q_rows.data(), s.kt.data(), s.score_rows.data(), count, dim);
        for (int64_t r = 0; r < count; ++r) {
          const int64_t token = active + r / group;
          const int64_t limit = std::min(n, first_pos + token + 1 - begin);
          const int64_t i = token * heads() + h * group + r % group;
          srt_cpu::softmax_block(s.score_rows[r], s.acc_rows[r], s.max[i], s.sum[i], limit, dim);
        }
        srt_cpu::value_rows(s.score_rows.data(), s.v_rows.data(), s.acc_rows.data(), count, n, dim);
      }
    }
    finish(t, s);
  }

  void finish(const Task& t, const Scratch<kv_t>& s) const {
    const int64_t n = (t.t1 - t.t0) * heads();
    q_t* dst = out + (start[t.b] + t.t0) * heads() * dim;
    for (int64_t i = 0; i < n; ++i) {
      const float inv = 1.0f / s.sum[i];
      const float* acc = s.acc.data() + i * dim;
      for (int64_t d = 0; d < dim; ++d) dst[i * dim + d] = srt_cpu::from_float<q_t>(acc[d] * inv);
    }
  }
};


// Tasks of kQueryTokens new tokens, the costliest (most keys x tokens) first, so the last task
// to start is a small one (dynamic scheduling).
std::vector<Task> plan_extend(const int64_t* prefix, const int64_t* ext, int64_t bs) {
  std::vector<Task> tasks;
  for (int64_t b = 0; b < bs; ++b) {
    for (int64_t t0 = 0; t0 < ext[b]; t0 += kQueryTokens) tasks.push_back({b, t0, std::min(ext[b], t0 + kQueryTokens)});
  }
  auto cost = [&](const Task& t) { return (prefix[t.b] + t.t1) * (t.t1 - t.t0); };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& x, const Task& y) { return cost(x) > cost(y); });
  return tasks;
}

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& req_to_token,
                  const at::Tensor& rows, const at::Tensor& prefix, const at::Tensor& ext) {
  for (const at::Tensor* t : {&q, &k, &v, &req_to_token, &rows, &prefix, &ext}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_extend_attention takes CPU tensors only, got ", t->device());
  }
  TORCH_CHECK(q.dim() == 3, "q must be [tokens, heads, head_dim], got ", q.sizes());
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
  TORCH_CHECK(rows.scalar_type() == at::kLong && prefix.scalar_type() == at::kLong && ext.scalar_type() == at::kLong,
              "req_pool_indices, prefix_lens and extend_lens must be int64");
  const int64_t bs = rows.size(0);
  TORCH_CHECK(rows.dim() == 1 && prefix.dim() == 1 && ext.dim() == 1 && prefix.size(0) == bs && ext.size(0) == bs,
              "req_pool_indices, prefix_lens and extend_lens must all be [batch]");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* p = prefix.data_ptr<int64_t>();
  const int64_t* e = ext.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(r[b] >= 0 && r[b] < req_to_token.size(0), "req_pool_indices[", b, "] = ", r[b], " is not a row");
    TORCH_CHECK(p[b] >= 0 && e[b] >= 1 && p[b] + e[b] <= req_to_token.size(1), "request ", b, ": prefix ", p[b],
                " + extend ", e[b], " must be a non-empty extend within the table's ", req_to_token.size(1), " columns");
    total += e[b];
  }
  TORCH_CHECK(q.size(0) == total, "q has ", q.size(0), " tokens, extend_lens sum to ", total);
}

template <typename q_t, typename kv_t>
void run_extend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& req_to_token,
                const at::Tensor& rows, const at::Tensor& prefix, const at::Tensor& ext, double scale, at::Tensor& out) {
  const int64_t bs = rows.size(0);
  std::vector<int64_t> start(bs);
  for (int64_t b = 0, s = 0; b < bs; s += ext.data_ptr<int64_t>()[b], ++b) start[b] = s;
  std::atomic<bool> bad_slot{false};
  Extend<q_t, kv_t> op;
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
  op.prefix = prefix.data_ptr<int64_t>();
  op.start = start.data();
  op.num_kv_heads = k.size(1);
  op.group = q.size(1) / k.size(1);
  op.dim = q.size(2);
  op.scale = static_cast<float>(scale);
  op.bad_slot = &bad_slot;
  const std::vector<Task> tasks = plan_extend(prefix.data_ptr<int64_t>(), ext.data_ptr<int64_t>(), bs);
  srt_cpu::parallel_tasks<Scratch<kv_t>>(
      static_cast<int64_t>(tasks.size()), [&] { return Scratch<kv_t>(q.size(1), q.size(2)); },
      [&](int64_t i, Scratch<kv_t>& s) { op.run(tasks[i], s); });
  TORCH_CHECK(!bad_slot.load(), "req_to_token holds a KV slot outside the pool of ", k.size(0), " slots");
}

}  // namespace

// q [tokens, heads, head_dim]: request b's extend_lens[b] new tokens, requests back to back, at
// positions prefix_lens[b] + t. Token t of request b attends to the KV slots
// req_to_token[req_pool_indices[b], :prefix_lens[b] + t + 1] of k_buffer / v_buffer
// [slots, kv_heads, head_dim]. Returns [tokens, heads, head_dim] in q's dtype.
at::Tensor paged_extend_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale) {
  const at::Tensor rows = req_pool_indices.contiguous();
  const at::Tensor prefix = prefix_lens.contiguous();
  const at::Tensor ext = extend_lens.contiguous();
  check_inputs(q, k_buffer, v_buffer, req_to_token, rows, prefix, ext);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const bool kv_bf16 = k_buffer.scalar_type() == at::kBFloat16;
  if (q_bf16 && kv_bf16) {
    run_extend<c10::BFloat16, c10::BFloat16>(q, k_buffer, v_buffer, req_to_token, rows, prefix, ext, scale, out);
  } else if (q_bf16) {
    run_extend<c10::BFloat16, float>(q, k_buffer, v_buffer, req_to_token, rows, prefix, ext, scale, out);
  } else if (kv_bf16) {
    run_extend<float, c10::BFloat16>(q, k_buffer, v_buffer, req_to_token, rows, prefix, ext, scale, out);
  } else {
    run_extend<float, float>(q, k_buffer, v_buffer, req_to_token, rows, prefix, ext, scale, out);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def(
      "paged_extend_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor prefix_lens, Tensor extend_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("paged_extend_attention", &paged_extend_attention); }
