// Device side of the split plan (plan.h): what one block of an attention
// kernel reads about its part. Shared by the portable and the Hopper kernel.
#pragma once

#include "../../platform/vendor.h"
#include "params.h"
#include "plan.h"

namespace mla {

struct Part {
  int b;            // sequence
  int tile_begin;   // first key tile
  int tile_end;     // one past the last key tile
  int split;        // index of this part within its sequence
  int nsplit;       // parts of the sequence (1: write the final output directly)
  int first_part;   // the sequence's first part (row of its partials)
  int L;            // the sequence's length, clamped to [0, max_len]: never read past the cache
};

// False for the blocks of grid.y beyond the planned parts (they exit).
MLA_DEVICE bool read_part(const AttnParams& p, int part, Part& out) {
  if (part >= p.plan[0]) return false;
  const int32_t* pi = p.plan + plan_part_base(p.bs) + 4 * part;
  out.b = pi[0];
  out.tile_begin = pi[1];
  out.tile_end = pi[2];
  out.split = pi[3];
  out.nsplit = p.plan[kPlanSeqBase + 2 * out.b];
  out.first_part = p.plan[kPlanSeqBase + 2 * out.b + 1];
  out.L = min(max(p.seqlens[out.b], 0), p.max_len);
  return true;
}

}  // namespace mla
