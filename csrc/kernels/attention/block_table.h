// Device side of a block table (paged caches): shared by the attention
// kernels and the rope-score pre-pass.
#pragma once

#include <cstdint>

#include "../../platform/vendor.h"

namespace mla {

// Entry i of a block table held to [0, num_pages): an id outside the cache
// reads page 0 in its place, so a bad id never reads outside the cache (the
// sequence's output is then unspecified; the serving API's checked mode
// refuses such tables before launching).
MLA_DEVICE int page_id(const int32_t* block_table, int64_t i, int64_t num_pages) {
  const int id = block_table[i];
  return id >= 0 && id < num_pages ? id : 0;
}

}  // namespace mla
