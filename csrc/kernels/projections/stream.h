// The bare stream: a read of n bytes at the device's streaming rate, the
// ceiling each weight stage of the step is measured against
// (benchmarks/bench_projections.py: a stage must read its weights at least
// once; this reads as many bytes and does nothing else).
#pragma once

#include <cstdint>

#include "../../platform/vendor.h"

namespace mla {

struct StreamParams {
  const void* src;  // 16-byte aligned
  int64_t n16;      // 16-byte pieces to read
  uint32_t* sink;   // one word, written only if the pieces fold to an impossible value (keeps the loads)
  int64_t threads;  // the grid's threads (the loop's stride)
};

// One launch of `blocks` blocks over p.src; an error string or nullptr.
const char* launch_stream_read(const StreamParams& p, int blocks, stream_t stream);

constexpr int kStreamThreads = 256;

}  // namespace mla
