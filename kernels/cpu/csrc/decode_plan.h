// The work plan of paged decode attention (paged_attention.cpp): each request's keys cut into
// fixed-size splits, splits of several requests over the same slots joined into one task, and the
// merges of requests with several splits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace srt_cpu_decode {

// Keys per task: equal-sized work items balance ragged rows over the threads. Fixed (not derived
// from the thread count) so a row's result never depends on the machine or the rest of the batch.
constexpr int64_t kSplitTokens = 256;

// One query of a task: request `b`'s heads. `part` < 0: the request has one split and the task
// writes its output itself; otherwise the index of its (max, sum, unnormalised output) partial.
struct Member {
  int64_t b, part;
};

// One unit of work: keys [begin, end), every head, for members [first, first + count) of
// Plan::members. All heads in one task, so the K and V rows of a slot ([kv_heads, head_dim],
// contiguous) are read together. Requests whose slots in [begin, end) are the same (a prefix the
// radix cache shares) are members of one task: each block of K and V rows is read from memory
// once for all of them, and each member's arithmetic is exactly what it would be alone.
struct Task {
  int64_t begin, end, first, count;
};

// A request whose splits are merged: partials [first, first + count).
struct Merge {
  int64_t b, first, count;
};

struct Plan {
  std::vector<Task> tasks;
  std::vector<Member> members;
  std::vector<Merge> merges;
  int64_t parts = 0;        // partials needed by requests with several splits
  int64_t max_splits = 1;   // the most splits of one request
  int64_t max_members = 1;  // the most members of one task
};

// Splits of kSplitTokens keys per request; with `share_prefixes`, splits of several requests
// that cover the same keys through the same slots become one task.
inline Plan plan_decode(const int64_t* lens, int64_t bs, const int32_t* req_to_token, int64_t r2t_s0, const int64_t* rows,
                        bool share_prefixes) {
  struct Split {
    int64_t begin, end, first_slot, b, part;
  };
  Plan plan;
  std::vector<Split> splits;
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t len = lens[b];
    const int64_t count = (len + kSplitTokens - 1) / kSplitTokens;
    plan.max_splits = std::max(plan.max_splits, count);
    const int64_t first = count > 1 ? plan.parts : -1;
    if (count > 1) {
      plan.merges.push_back({b, first, count});
      plan.parts += count;
    }
    for (int64_t i = 0; i < count; ++i) {
      const int64_t begin = i * kSplitTokens, end = std::min(len, begin + kSplitTokens);
      splits.push_back({begin, end, req_to_token[rows[b] * r2t_s0 + begin], b, count > 1 ? first + i : -1});
    }
  }
  if (share_prefixes) {
    // Candidates for one task are next to each other: same keys, same first slot.
    std::sort(splits.begin(), splits.end(), [](const Split& x, const Split& y) {
      return std::tie(x.begin, x.end, x.first_slot, x.b) < std::tie(y.begin, y.end, y.first_slot, y.b);
    });
  }
  std::vector<bool> taken(splits.size(), false);
  for (size_t i = 0; i < splits.size(); ++i) {
    if (taken[i]) continue;
    const Split& lead = splits[i];
    const int32_t* lead_slots = req_to_token + rows[lead.b] * r2t_s0 + lead.begin;
    const size_t bytes = (lead.end - lead.begin) * sizeof(int32_t);
    Task task{lead.begin, lead.end, static_cast<int64_t>(plan.members.size()), 0};
    for (size_t j = i; j < splits.size(); ++j) {
      const Split& other = splits[j];
      if (j > i && (!share_prefixes || other.begin != lead.begin || other.end != lead.end ||
                    other.first_slot != lead.first_slot)) {
        break;
      }
      if (taken[j] || (j > i && std::memcmp(req_to_token + rows[other.b] * r2t_s0 + other.begin, lead_slots, bytes))) {
        continue;
      }
      taken[j] = true;
      plan.members.push_back({other.b, other.part});
      ++task.count;
    }
    plan.max_members = std::max(plan.max_members, task.count);
    plan.tasks.push_back(task);
  }
  // Largest first, so the last task to start is a small one (dynamic scheduling).
  std::stable_sort(plan.tasks.begin(), plan.tasks.end(), [](const Task& x, const Task& y) {
    return (x.end - x.begin) * x.count > (y.end - y.begin) * y.count;
  });
  return plan;
}

}  // namespace srt_cpu_decode
