// The split planner (plan.h): one launch ahead of the attention that cuts
// every sequence into parts of whole key tiles, on the device from the
// lengths (no host synchronisation, so it is captured with the call).
// Shared by the portable and the Hopper attention kernel.
#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "../../platform/vendor.h"

#include "attention.h"
#include "plan.h"

namespace mla {
namespace {

// One block of p.threads (<= kPlanThreads, a multiple of 64: bs rounded up,
// so that a small batch pays for few threads in its barriers). Splits every
// sequence into parts of about `per_part` tiles: per_part is the candidate
// (P0 = total / target_parts, 1.25, 1.5 or 2 P0, or the longest sequence cut
// into its share of the slots) with the smallest estimated makespan on the
// target_parts slots (the longest part, the work per slot, or the waves of
// parts beyond the slots, whichever is largest), counting a fixed cost per
// part and one for the combine when a sequence is split. (P0 alone cuts
// sequences just longer than P0 in two: twice the parts, in two waves, plus
// the combine; see docs/attention.md. MLA_DECODE_PLAN_P0=1 keeps P0 alone for
// measurements.) With p.no_split every sequence is one part (the plan of a
// call that launches no combine: the decode step at a batch of at least
// target_parts sequences of one length, which the candidates above never
// split either). Batches of lengths that differ, with fewer sequences than
// slots (and at most one per thread), are cut differently: fixed_chunks()
// below. The planner is on the critical path of every call: the attention
// kernel waits for it.
constexpr int kPlanThreads = 1024;
constexpr int kPlanCands = 5;
constexpr float kPartCost = 1.0f;     // per part, in tiles (a work item's fixed cost)
constexpr float kCombineCost = 1.0f;  // when any sequence is split, in tiles

// The plan of a batch whose lengths differ, with fewer sequences than
// slots (p.target_parts), one per thread (p.bs <= threads). The blocks take
// parts in plan order as they free up (list scheduling), so the plan is
// longest-part-first over all parts (LPT), and parts are fixed chunks: a
// sequence of t tiles is cut into n - 1 chunks of c tiles and a last part of
// the rest (1..c, with a one-key tile under p.tail_free), the chunks of every
// sequence first, then the last parts from the longest down. c is the
// candidate (total / slots = P0 times 1/2, 3/4, 1, 9/8, 5/4, 3/2 or 2, or the
// longest sequence: no split) with the smallest estimated makespan, each
// part costing kPartCost more: the largest of the longest part, the work per
// slot and, with more parts than slots, the S-th and (S+1)-th longest parts
// on one slot (of the S + 1 longest parts two share a slot), plus
// kCombineCost when a sequence is split; ties go to fewer parts. Candidates
// of more than p.max_parts parts are skipped (P0 and above never have more).
// (The equal parts in sequence order below, longest sequence first, left
// the last wave to a few long parts of the longest sequences: serving
// batches at h_q 16-64 ran 1.2-1.3x slower; docs/attention.md.)
__device__ void fixed_chunks(const PlanParams& p, int own_tiles, int total, int longest, int p0, int tid, int* scan,
                             int* rem_s, int L) {
  constexpr int kCands = 8;
  __shared__ int c_np, c_full, c_stat[2];
  __shared__ int chosen;
  __shared__ float best_s;
  __shared__ int best_np;
  const int slots = p.target_parts;
  const bool mine = tid < p.bs;
  if (tid == 0) {
    best_s = 3.0e38f;
    best_np = 0x7fffffff;
    chosen = max(1, longest);
  }
  // a thread's rank among the last parts (longest first, ties by sequence;
  // unrolled further, gfx942 spilled the comparisons' SGPR masks)
  auto rank_of = [&](int r) {
    int k = 0;
#pragma unroll 4
    for (int o = 0; o < p.bs; ++o) {
      const int ro = rem_s[o];
      k += (ro > r || (ro == r && o < tid)) ? 1 : 0;
    }
    return k;
  };
#pragma unroll 1
  for (int ci = 0; ci < kCands; ++ci) {
    const int eighths = ci == 0 ? 4 : ci == 1 ? 6 : ci == 2 ? 8 : ci == 3 ? 9 : ci == 4 ? 10 : ci == 5 ? 12 : 16;
    const int c = ci == kCands - 1 ? max(1, longest) : max(1, p0 * eighths / 8);
    const int t = own_tiles;
    const int n = t > 0 ? (t + c - 1) / c : 1;
    const int r = t - (n - 1) * c;  // the last part (0: an empty sequence)
    if (tid == 0) {
      c_np = 0;
      c_full = 0;
      c_stat[0] = c_stat[1] = c;
    }
    if (mine) rem_s[tid] = r;
    sync_threads();
    if (mine) {
      atomic_add_relaxed(&c_np, n);
      if (n > 1) atomic_add_relaxed(&c_full, n - 1);
    }
    sync_threads();
    const int np = c_np, full = c_full;
    // the slots-th and (slots + 1)-th longest parts (1-based): chunks of c
    // first, then the last parts by rank
    if (np > slots && full < slots + 1 && mine) {
      const int k = rank_of(r);
      if (k == slots - 1 - full) c_stat[0] = r;
      if (k == slots - full) c_stat[1] = r;
    }
    sync_threads();
    if (tid == 0 && np <= p.max_parts) {
      const float pmax = static_cast<float>(full > 0 ? c : longest) + kPartCost;
      const float per_slot = (static_cast<float>(total) + kPartCost * static_cast<float>(np)) / static_cast<float>(slots);
      const float pair = np > slots ? static_cast<float>(c_stat[0] + c_stat[1]) + 2.0f * kPartCost : 0.0f;
      const float est = fmaxf(fmaxf(pmax, per_slot), pair) + (np > p.bs ? kCombineCost : 0.0f);
      if (est < best_s || (est == best_s && np < best_np)) {
        best_s = est;
        best_np = np;
        chosen = c;
      }
    }
    sync_threads();
  }
  const int c = chosen;
  const int t = own_tiles;
  const int n = mine ? (t > 0 ? (t + c - 1) / c : 1) : 0;
  const int r = t - (n - 1) * c;
  if (mine) rem_s[tid] = r;
  // exclusive prefixes of the chunks (n - 1, low 16 bits) and the parts (n,
  // high 16 bits) in sequence order: both sums stay below 2^16 (max_parts)
  uint32_t* uscan = reinterpret_cast<uint32_t*>(scan);
  uscan[tid] = mine ? (static_cast<uint32_t>(n) << 16) | static_cast<uint32_t>(n - 1) : 0u;
  sync_threads();
  for (int off = 1; off < p.threads; off <<= 1) {  // inclusive Hillis-Steele scan
    const uint32_t v = tid >= off ? uscan[tid - off] : 0u;
    sync_threads();
    uscan[tid] += v;
    sync_threads();
  }
  const uint32_t all_sum = uscan[p.threads - 1];
  const int nfull = static_cast<int>(all_sum & 0xffffu), nparts = static_cast<int>(all_sum >> 16);
  if (mine) {
    const uint32_t incl = uscan[tid];
    const int chunk0 = static_cast<int>(incl & 0xffffu) - (n - 1);  // this sequence's first chunk's place
    const int first = static_cast<int>(incl >> 16) - n;              // its first part (row of its partials)
    const int last_at = nfull + rank_of(r);                          // its last part's place
    const int b = tid;
    p.plan[kPlanSeqBase + 2 * b] = n;
    p.plan[kPlanSeqBase + 2 * b + 1] = first;
    const int all = L > 0 ? (L + p.tile - 1) / p.tile : 0;  // (t, or one more: the one-key tile)
    for (int s = 0; s < n; ++s)
      write_part(p.plan, p.bs, s == n - 1 ? last_at : chunk0 + s, b, s * c, s == n - 1 ? all : (s + 1) * c, s, n,
                 first, L);
  }
  if (tid == 0) {
    p.plan[0] = nparts;
    p.plan[1] = c;
    p.plan[plan_counter(p.bs, p.max_parts)] = 0;
    p.plan[plan_counter(p.bs, p.max_parts) + 1] = 0;
  }
}

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const PlanParams p) {
  __shared__ int scan[kPlanThreads];
  __shared__ int tiles_s[kPlanThreads];
  __shared__ int total_s;
  pdl_trigger();  // the attention kernel may start its prologue; it waits for this plan before reading it
  const int tid = thread_x();
  int fill_len = p.fill_len;
  if (p.len_slot != nullptr) {  // read by thread 0 alone, which then advances it by its step for the next replay
    __shared__ int slot_s;
    if (tid == 0) slot_s = p.len_slot[0];
    sync_threads();
    fill_len = slot_s;
    if (tid == 0) p.len_slot[0] = fill_len + p.len_slot[1];
  }
  if (p.fill_lens != nullptr)  // (read by the kernels after this one, which the stream orders after it)
    for (int b = tid; b < p.bs; b += p.threads) p.fill_lens[b] = fill_len;
  // sequence b's length as the attention reads it: held to [0, the cache's capacity] (never read past the cache)
  auto len_of = [&](int b) { return min(max(p.fill_lens != nullptr ? fill_len : p.seqlens[b], 0), p.max_len); };
  auto len_tiles = [&](int L) { return L > 0 ? (L + p.tile - 1) / p.tile : 0; };
  // The tiles a sequence's parts are cut from: with p.tail_free a last tile
  // holding one key is left out (the attention adds that key to the last part
  // at next to no cost: a part of its own would cost a whole work item).
  auto tiles_from_len = [&](int b) {
    const int L = len_of(b);
    const int t = len_tiles(L);
    return p.tail_free && t > 1 && L - (t - 1) * p.tile == 1 ? t - 1 : t;
  };
  // sequence tid's tiles, read once (with bs <= threads, a thread's only
  // sequence: the candidate loop and the part order below reuse it)
  const int own_tiles = tid < p.bs ? tiles_from_len(tid) : 0;
  auto tiles_of = [&](int b) { return b == tid ? own_tiles : tiles_from_len(b); };
  // total tiles (an empty sequence counts one: it still gets a part) and the longest sequence
  __shared__ int longest_s, shortest_s;
  int mine = 0, longest = 0, shortest = 0x7fffffff;
  const int nt = p.threads;
  for (int b = tid; b < p.bs; b += nt) {
    const int t = tiles_of(b);
    mine += t > 0 ? t : 1;
    longest = max(longest, t);
    shortest = min(shortest, t);
  }
  if (tid == 0) {
    total_s = 0;
    longest_s = 1;
    shortest_s = 0x7fffffff;
  }
  sync_threads();
  if (mine != 0) atomic_add_relaxed(&total_s, mine);
  if (longest > 1) atomic_max_relaxed(&longest_s, longest);
  if (shortest != 0x7fffffff) atomic_min_relaxed(&shortest_s, shortest);
  sync_threads();
  const int p0 = max(1, (total_s + p.target_parts - 1) / p.target_parts);
  if (!p.no_split && !p.p0_only && p.bs <= nt && p.bs < p.target_parts && shortest_s != longest_s) {
    fixed_chunks(p, own_tiles, total_s, longest_s, p0, tid, scan, tiles_s,
                 tid < p.bs ? len_of(tid) : 0);
    return;
  }
  int per_part = p0;
  if (p.no_split) {  // every sequence one part: per_part = the longest sequence's tiles
    per_part = longest_s;
  } else if (!p.p0_only) {
    // per candidate: the parts, and the shortest and longest part (a
    // sequence of t tiles in n parts: n - 1 parts of ceil(t / n) tiles and the rest)
    __shared__ int cand_parts[kPlanCands], cand_min[kPlanCands], cand_max[kPlanCands];
    __shared__ int chosen;
    // P0, 1.25, 1.5 and 2 P0, and the longest sequence cut into as many
    // parts as its share of the slots (k; at one length: every sequence in k
    // parts, the most parts that fit the slots in one wave)
    const int k = max(1, static_cast<int>(static_cast<int64_t>(p.target_parts) * longest_s / total_s));
    const int fit = (longest_s + k - 1) / k;
    auto cand = [&](int c) { return c == 4 ? fit : c == 3 ? 2 * p0 : p0 + c * p0 / 4; };
    if (tid < kPlanCands) {
      cand_parts[tid] = 0;
      cand_min[tid] = 0x7fffffff;
      cand_max[tid] = 0;
    }
    sync_threads();
#pragma unroll 1
    for (int c = 0; c < kPlanCands; ++c) {
      const int pc = cand(c);
      int np = 0, pmin = 0x7fffffff, pmax = 0;
      for (int b = tid; b < p.bs; b += nt) {
        const int t = tiles_of(b), n = max(1, (t + pc - 1) / pc), size = (t + n - 1) / n;
        np += n;
        pmin = min(pmin, max(0, t - (n - 1) * size));
        pmax = max(pmax, size);
      }
      if (np != 0) {
        atomic_add_relaxed(&cand_parts[c], np);
        atomic_min_relaxed(&cand_min[c], pmin);
        atomic_max_relaxed(&cand_max[c], pmax);
      }
    }
    sync_threads();
    // thread 0 estimates each candidate's makespan on the target_parts slots,
    // each part costing kPartCost more: the largest of three lower bounds,
    // the longest part, the work per slot, and ceil(parts / slots) parts of
    // at least the shortest size on one slot (parts beyond the slots run in
    // a further wave: 384 parts of 171 tiles on 264 slots take 342, not the
    // 250 of the work per slot); ties go to fewer parts
    if (tid == 0) {
      const float slots = static_cast<float>(p.target_parts);
      float best = 3.0e38f;
      int pick = p0, pick_parts = 0x7fffffff;
#pragma unroll 1
      for (int c = 0; c < kPlanCands; ++c) {
        const int np = cand_parts[c];
        const float per_slot = (static_cast<float>(total_s) + kPartCost * static_cast<float>(np)) / slots;
        const float waves = static_cast<float>((np + p.target_parts - 1) / p.target_parts);
        const float est = fmaxf(fmaxf(static_cast<float>(cand_max[c]) + kPartCost, per_slot),
                                waves * (static_cast<float>(cand_min[c]) + kPartCost)) +
                          (np > p.bs ? kCombineCost : 0.0f);
        if (est < best || (est == best && np < pick_parts)) {
          best = est;
          pick = cand(c);
          pick_parts = np;
        }
      }
      chosen = pick;
    }
    sync_threads();
    per_part = chosen;
  }

  // Part order. Blocks are started roughly in part order as SMs free up, so
  // with lengths that differ, longest-first keeps the SMs' totals even (LPT
  // list scheduling). One chunk (bs <= threads): slot = rank of the
  // sequence by tiles, descending (ties by index); more: index order.
  const bool lpt = p.bs <= nt;
  int carry = 0;  // parts of the sequences before this chunk
  for (int base = 0; base < p.bs; base += nt) {
    const int b = base + tid;
    const int tiles = b < p.bs ? tiles_of(b) : 0;
    const int n = b < p.bs ? max(1, (tiles + per_part - 1) / per_part) : 0;
    int slot = tid;
    if (lpt) {
      tiles_s[tid] = tiles;
      sync_threads();
      if (b < p.bs) {
        slot = 0;
        for (int o = 0; o < p.bs; ++o) {
          const int to = tiles_s[o];
          slot += (to > tiles || (to == tiles && o < b)) ? 1 : 0;
        }
      }
    }
    scan[tid] = 0;
    sync_threads();
    scan[slot] = n;  // slots are a permutation of 0..bs-1 (or the identity)
    sync_threads();
    for (int off = 1; off < nt; off <<= 1) {  // inclusive Hillis-Steele scan
      const int v = tid >= off ? scan[tid - off] : 0;
      sync_threads();
      scan[tid] += v;
      sync_threads();
    }
    if (b < p.bs) {
      const int first = carry + scan[slot] - n;
      p.plan[kPlanSeqBase + 2 * b] = n;
      p.plan[kPlanSeqBase + 2 * b + 1] = first;
      const int per_split = (tiles + n - 1) / n;
      const int L = len_of(b);
      const int all = len_tiles(L);  // (tiles, or one more: the last part ends with the one-key tile)
      for (int s = 0; s < n; ++s)
        write_part(p.plan, p.bs, first + s, b, min(s * per_split, tiles),
                   s == n - 1 ? all : min((s + 1) * per_split, tiles), s, n, first, L);
    }
    carry += scan[nt - 1];
    sync_threads();
  }
  if (tid == 0) {
    p.plan[0] = carry;
    p.plan[1] = per_part;
    p.plan[plan_counter(p.bs, p.max_parts)] = 0;
    p.plan[plan_counter(p.bs, p.max_parts) + 1] = 0;
  }
}

// Sets a captured step's length slot (PlanParams::len_slot) before a replay
// whose length is not the one its last replay left there.
__global__ void set_len_kernel(int32_t* slot, int v, int step) {
  slot[0] = v;
  slot[1] = step;
}

// Work-counter pairs for calls captured in CUDA graphs (AttnParams::counter),
// zero at module load. A captured call keeps its pair for the graph's life;
// the kernel's last block leaves it zeroed (release_plan), so every replay
// starts at zero with no zeroing launch. A graph executable never runs
// concurrently with itself, so no two launches share a pair.
#if MLA_NVIDIA
constexpr int kCounterPoolPairs = 1 << 16;
__device__ int32_t g_counter_pool[2 * kCounterPoolPairs];
#endif

// Zeroes a call's work-counter pair (AttnParams::counter). The dependent
// attention may launch at once (its own pdl_wait then waits for this grid);
// the writes wait for the kernel before it, which may still be using the
// pair's memory (stream-ordered reuse by the caching allocator).
__global__ void zero_pair_kernel(int32_t* pair) {
  pdl_trigger();
  pdl_wait();
  pair[0] = 0;
  pair[1] = 0;
}

}  // namespace

const char* launch_zero_pair(int32_t* pair, bool pdl, stream_t stream) {
#if MLA_NVIDIA
  return launch_ex(zero_pair_kernel, dim3(1), dim3(1), 0, stream, pdl, dim3(1, 1, 1), pair);
#else
  (void)pdl;
  zero_pair_kernel<<<1, 1, 0, stream>>>(pair);
  return last_launch_error();
#endif
}

#if MLA_NVIDIA
namespace {
struct CounterPool {
  int32_t* base = nullptr;  // g_counter_pool on the device (nullptr: not looked up)
  int used = 0;             // pairs handed out
};
std::mutex g_pool_mu;
std::unordered_map<int, CounterPool> g_pools;  // by device index
}  // namespace
#endif

void prepare_counter_pool(int device) {
#if MLA_NVIDIA
  std::lock_guard<std::mutex> lock(g_pool_mu);
  CounterPool& pool = g_pools[device];
  if (pool.base != nullptr) return;
  void* addr = nullptr;
  if (cudaGetSymbolAddress(&addr, g_counter_pool) == cudaSuccess)
    pool.base = static_cast<int32_t*>(addr);
  else
    (void)cudaGetLastError();  // (the calls then zero a pair of their own)
#else
  (void)device;
#endif
}

int32_t* captured_counter_pair(int device) {
#if MLA_NVIDIA
  std::lock_guard<std::mutex> lock(g_pool_mu);
  auto it = g_pools.find(device);
  if (it == g_pools.end() || it->second.base == nullptr || it->second.used >= kCounterPoolPairs) return nullptr;
  return it->second.base + 2 * it->second.used++;
#else
  (void)device;
  return nullptr;
#endif
}

const char* launch_set_len(int32_t* slot, int v, int step, stream_t stream) {
  set_len_kernel<<<1, 1, 0, stream>>>(slot, v, step);
  return last_launch_error();
}

const char* launch_plan(const PlanParams& p, stream_t stream) {
  if (p.bs <= 0 || p.target_parts <= 0 || p.tile <= 0) return "launch_plan: bad parameters";
  if (p.len_slot != nullptr && p.fill_lens == nullptr) return "launch_plan: len_slot needs fill_lens";
  PlanParams q = p;
  q.threads = std::min(kPlanThreads, (p.bs + 63) / 64 * 64);
  plan_kernel<<<1, q.threads, 0, stream>>>(q);
  return last_launch_error();
}

}  // namespace mla
