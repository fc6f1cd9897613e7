// The fp8 instances of the Hopper attention kernel (an e4m3 cache with one
// scale per tensor, dv 512, rope 64 as stored, bf16 q and out): the kernel of
// attention_sm90.cu with its keys loaded by TMA as bytes and widened to fp16
// in shared memory (kKeysFp8Dense / kKeysFp8Paged there). In a translation
// unit of their own, so that the other instances are compiled as they are
// without them (nvcc's inlining follows the set of kernels compiled together).
#define MLA_SM90_FP8_TU
#include "attention_sm90.cu"

namespace mla {

#if MLA_NVIDIA
const char* attn_kernel_info_sm90_fp8(int* blocks_per_sm) {
  using T = PairTile<512>;
  int blocks = 0x7fffffff;
  const char* e = nullptr;
  auto one = [&](auto kernel) {
    if (e == nullptr) e = set_max_dynamic_smem(kernel, T::kSmem);
    if (e == nullptr) blocks = std::min(blocks, max_active_blocks(kernel, T::kThreads, T::kSmem));
  };
  one(attention_sm90_kernel<true, 512, false, kKeysFp8Dense>);
  one(attention_sm90_kernel<true, 512, false, kKeysFp8Paged>);
  if (e != nullptr) return e;
  *blocks_per_sm = blocks;
  return blocks > 0 ? nullptr : "sm90 fp8 attention kernel cannot be resident on this device (occupancy 0)";
}

// As launch<512, false> in attention_sm90.cu (persistent, a programmatic
// dependent of the planner), with the fp8 instances.
const char* launch_attention_sm90_fp8(const AttnParams& p_in, stream_t stream) {
  using T = PairTile<512>;
  if (!p_in.kv_fp8 || p_in.dv != 512 || p_in.rope != 64 || p_in.rope_cs != nullptr || p_in.kpe != nullptr ||
      p_in.rope_scores != nullptr || p_in.f16)
    return "launch_attention_sm90_fp8: an fp8 cache takes dv 512, rope 64, bf16 q, the keys as stored";
  const int cap = switches().attn_ctas;
  AttnParams p = p_in;
  if (!switches().persist) p.ctas = 0;
  if (cap > 0 && p.ctas > cap) p.ctas = cap;
  const int64_t items = static_cast<int64_t>(p.max_parts) * ((p.rows + T::kM - 1) / T::kM);
  const int64_t blocks = p.ctas > 0 ? std::min<int64_t>(p.ctas, items) : items;
  if (blocks <= 0 || blocks > 0x7fffffff) return "launch_attention_sm90_fp8: bad number of work items";
  const TmaMaps maps = make_maps(p);
  if (!maps.use) return "launch_attention_sm90_fp8: the fp8 cache needs TMA (dense, or pages of a multiple of 64 rows)";
  const dim3 grid(static_cast<unsigned>(blocks));
  const bool pdl = sm90_pdl_enabled();
  auto go = [&](auto kernel) { return launch_ex(kernel, grid, dim3(T::kThreads), T::kSmem, stream, pdl, dim3(1), p, maps); };
  return p.block_table != nullptr ? go(attention_sm90_kernel<true, 512, false, kKeysFp8Paged>)
                                  : go(attention_sm90_kernel<true, 512, false, kKeysFp8Dense>);
}
#else
const char* attn_kernel_info_sm90_fp8(int*) { return "the sm90 attention kernel is NVIDIA-only"; }
const char* launch_attention_sm90_fp8(const AttnParams&, stream_t) { return "the sm90 attention kernel is NVIDIA-only"; }
#endif

}  // namespace mla
