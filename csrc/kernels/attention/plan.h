// The split planner's output layout (int32, on the device), shared by the
// planner, the attention kernel and the combine kernel.
//
//   plan[0]                          number of parts actually used (<= max_parts)
//   plan[1]                          tiles per part chosen
//   plan[kSeqBase + 2*b + 0]         number of splits of sequence b
//   plan[kSeqBase + 2*b + 1]         index of sequence b's first part
//   plan[kPartBase(bs) + 8*p + 0..7] part p: sequence, first tile, end tile, split index,
//                                    splits of the sequence, its first part, its length
//                                    (clamped to [0, max_len]), 0 (one 32-byte read, no
//                                    dependent reads of the lengths and the sequence table)
//   plan[plan_counter(bs, max_parts)] work counter of the persistent Hopper kernel (0 after
//                                    the planner; its blocks take their next item from it)
//   plan[plan_counter(...) + 1]      blocks of that kernel done; the last one to finish sets
//                                    both back to 0. Used by the call that made the plan (the
//                                    decode step); a call given a plan made before it counts
//                                    in a zeroed pair of its own (AttnParams::counter) and
//                                    reads the lengths at the call (AttnParams::live_lens)
//
// A part is a contiguous range of key tiles of one sequence; a sequence of
// length 0 still gets one (empty) part so that its output is written.
#pragma once

#include "../../platform/vendor.h"

namespace mla {

constexpr int kPlanSeqBase = 2;
constexpr int kPartInts = 8;
MLA_HOST_DEVICE constexpr int plan_part_base(int bs) { return (kPlanSeqBase + 2 * bs + 7) / 8 * 8; }  // 32-byte aligned
MLA_HOST_DEVICE constexpr int plan_counter(int bs, int max_parts) { return plan_part_base(bs) + kPartInts * max_parts; }
MLA_HOST_DEVICE constexpr int plan_size(int bs, int max_parts) { return plan_counter(bs, max_parts) + 2; }

struct PlanParams {
  const int32_t* seqlens;  // [bs]
  int32_t* plan;           // [plan_size(bs, max_parts)]
  int bs;
  int max_parts;           // target_parts + bs
  int target_parts;        // parts wanted for one head block (SM count derived)
  int tile;                // keys per tile of the attention kernel
  int s_q;                 // (causal rows never see more than the sequence)
  int max_len;             // cache capacity: lengths are clamped to [0, max_len]
  int threads;             // block size (set by launch_plan)
  int p0_only;             // 1: per_part = total / target_parts, no candidates (MLA_DECODE_PLAN_P0=1)
  int no_split;            // 1: one part per sequence (max_parts = bs): a plan for calls without a combine
  int tail_free;           // 1: a last tile of one key is not counted when parts are cut; it goes to the
                           // sequence's last part (AttnKernelInfo::one_key_tail)
  int32_t* fill_lens;      // non-null: every length is fill_len, written to fill_lens[0 .. bs) as the plan is
  int fill_len;            // made (seqlens unread): the decode step's lengths and plan in one launch
  int32_t* len_slot;       // non-null (with fill_lens): int32 [2], {length, step}: fill_len is read from
                           // len_slot[0], which the planner then advances by len_slot[1] (a captured
                           // step's length, carried from replay to replay: step 1 for a cache that grows
                           // a row per call, 0 for calls that repeat one length on fresh caches)
};

// Part `at` of the plan (read back by read_part, part.h): sequence b's tiles
// [begin, end), split s of its n, the sequence's first part, its length L.
MLA_HOST_DEVICE void write_part(int32_t* plan, int bs, int at, int b, int begin, int end, int s, int n, int first,
                                int L) {
  int4* out = reinterpret_cast<int4*>(plan + plan_part_base(bs) + kPartInts * at);  // (32-byte aligned)
  out[0] = make_int4(b, begin, end, s);
  out[1] = make_int4(n, first, L, 0);
}

// The plan plan_kernel makes with no_split when every one of the p.bs
// sequences has length p.fill_len (a decode step's batch), and the lengths
// into p.fill_lens: the same ints, written by threads `lane` of `lanes` of a
// kernel that runs before the attention anyway (the fused query), so that
// such a call needs no planner launch. A sequence is one part of all its
// tiles; parts in sequence order (longest-first among equal lengths); the
// work counter pair zeroed. p.plan must hold plan_size(p.bs, p.bs) ints.
MLA_HOST_DEVICE void write_uniform_plan(const PlanParams& p, int lane, int lanes) {
  const int L = p.fill_len < 0 ? 0 : (p.fill_len > p.max_len ? p.max_len : p.fill_len);
  const int tiles = L > 0 ? (L + p.tile - 1) / p.tile : 0;
  for (int b = lane; b < p.bs; b += lanes) {
    p.fill_lens[b] = p.fill_len;
    p.plan[kPlanSeqBase + 2 * b] = 1;      // splits
    p.plan[kPlanSeqBase + 2 * b + 1] = b;  // first part
    write_part(p.plan, p.bs, b, b, 0, tiles, 0, 1, b, L);
  }
  if (lane == 0) {
    p.plan[0] = p.bs;
    p.plan[1] = tiles > 1 ? tiles : 1;
    p.plan[plan_counter(p.bs, p.bs)] = 0;
    p.plan[plan_counter(p.bs, p.bs) + 1] = 0;
  }
}

}  // namespace mla
