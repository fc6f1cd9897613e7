// Device side of a block table (paged caches): shared by the attention
// kernels and the rope-score pre-pass.
#pragma once

#include <cstdint>

#include "../../platform/vendor.h"

namespace mla {

// A block-table entry held to [0, num_pages): an id outside the cache reads
// page 0 in its place, so a bad id never reads outside the cache (the
// sequence's output is then unspecified; the serving API's checked mode
// refuses such tables before launching).
MLA_DEVICE int held_page_id(int id, int64_t num_pages) { return id >= 0 && id < num_pages ? id : 0; }

// Entry i of a block table, held. (A kernel that reads entries ahead keeps
// the raw entry and holds it at its use, so that no compare waits on the read.)
MLA_DEVICE int page_id(const int32_t* block_table, int64_t i, int64_t num_pages) {
  return held_page_id(block_table[i], num_pages);
}

}  // namespace mla
