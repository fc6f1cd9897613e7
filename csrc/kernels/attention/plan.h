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
  int32_t* fill_lens;      // non-null: every length is fill_len, written to fill_lens[0 .. bs) as the plan is
  int fill_len;            // made (seqlens unread): the decode step's lengths and plan in one launch
  int32_t* len_slot;       // non-null (with fill_lens): int32 [2], {length, step}: fill_len is read from
                           // len_slot[0], which the planner then advances by len_slot[1] (a captured
                           // step's length, carried from replay to replay: step 1 for a cache that grows
                           // a row per call, 0 for calls that repeat one length on fresh caches)
};

}  // namespace mla
