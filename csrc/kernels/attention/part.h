// Device side of the split plan (plan.h): what one block of an attention
// kernel reads about its part. Shared by the portable and the Hopper kernel.
#pragma once

#include "../../platform/vendor.h"
#include "block_table.h"  // (each kernel that reads its part reads the block table too)
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
// `tile`: the kernel's keys per planned tile. With p.live_lens (a plan made
// before the call) the length is the sequence's now, not the planned one: a
// part's tiles are cut at it, and the sequence's last part runs to it, so a
// plan of other lengths still covers every key exactly once (its balance is
// the old lengths').
MLA_DEVICE bool read_part(const AttnParams& p, int part, Part& out, int tile) {
  if (part < 0 || part >= p.plan[0]) return false;
  const int4* pi = reinterpret_cast<const int4*>(p.plan + plan_part_base(p.bs) + kPartInts * part);
  const int4 a = pi[0], c = pi[1];  // (independent of each other and of plan[0])
  out.b = a.x;
  out.tile_begin = a.y;
  out.tile_end = a.z;
  out.split = a.w;
  out.nsplit = c.x;
  out.first_part = c.y;
  out.L = min(c.z, p.max_len);  // (the planner clamped it to its capacity; a plan passed in is held to the call's)
  if (p.live_lens) {
    out.L = min(max(p.seqlens[out.b], 0), p.max_len);
    const int tiles = (out.L + tile - 1) / tile;
    out.tile_end = out.split == out.nsplit - 1 ? tiles : min(out.tile_end, tiles);
    out.tile_end = max(out.tile_end, out.tile_begin);  // (an empty part: lse -inf, as an empty sequence's)
  }
  return true;
}

}  // namespace mla
