// The split planner's output layout (int32, on the device), shared by the
// planner, the attention kernel and the combine kernel.
//
//   plan[0]                          number of parts actually used (<= max_parts)
//   plan[1]                          tiles per part chosen
//   plan[kSeqBase + 2*b + 0]         number of splits of sequence b
//   plan[kSeqBase + 2*b + 1]         index of sequence b's first part
//   plan[kPartBase(bs) + 4*p + 0..3] part p: sequence, first tile, end tile, split index
//
// A part is a contiguous range of key tiles of one sequence; a sequence of
// length 0 still gets one (empty) part so that its output is written.
#pragma once

#include "../../platform/vendor.h"

namespace mla {

constexpr int kPlanSeqBase = 2;
MLA_HOST_DEVICE constexpr int plan_part_base(int bs) { return kPlanSeqBase + 2 * bs; }
MLA_HOST_DEVICE constexpr int plan_size(int bs, int max_parts) { return plan_part_base(bs) + 4 * max_parts; }

struct PlanParams {
  const int32_t* seqlens;  // [bs]
  int32_t* plan;           // [plan_size(bs, max_parts)]
  int bs;
  int max_parts;           // target_parts + bs
  int target_parts;        // parts wanted for one head block (SM count derived)
  int tile;                // keys per tile of the attention kernel
  int s_q;                 // (causal rows never see more than the sequence)
  int max_len;             // cache capacity: lengths are clamped to [0, max_len]
};

}  // namespace mla
