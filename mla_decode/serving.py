"""FlashMLA's serving interface on mla_decode's kernels.

Code written for FlashMLA runs by changing one import::

    from mla_decode import get_mla_metadata, flash_mla_with_kvcache

    tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, dv,
                                      tile_scheduler_metadata, num_splits, causal=True)

Same argument and return contract as FlashMLA (out [b, s_q, h_q, dv] in q's
dtype, lse [b, h_q, s_q] fp32, natural log). Beyond FlashMLA: page block
sizes 1, 16, 32, 64, 128 (any size >= 1 works; those are tested), any h_q
(16, 24, 32, 64, 128 tested) with one KV head, s_q 1..4 with causal masking.

Differences a caller should know:
- ``tile_scheduler_metadata`` is the split plan get_mla_metadata made on
  the device, and a call at DeepSeek's shape (d 576, dv 512, no kpe_cache)
  uses it, as FlashMLA does: no planner launch in the call. Unlike
  FlashMLA's, a plan for other lengths cannot give a wrong answer: each
  call reads every sequence's length from ``cache_seqlens`` as it is then
  and runs the sequence's last part to it (a stale plan only balances the
  work by the old lengths), so a captured CUDA/HIP graph stays right when
  lengths and block tables change in place; and the kernel's work counter
  is the call's own, so one plan may serve calls on several streams at
  once. Other shapes plan inside the call (one planner launch, no host
  synchronisation); so does metadata made for other sizes (another
  ``num_heads_per_head_k`` than the call's s_q * h_q),
  with a RuntimeWarning once per batch and head count, since each such call
  then pays the planner and a refused attempt first.
- A sequence of length 0 gives out = 0 and lse = -inf (log of an empty sum),
  never NaN.
- Supported: bf16 and fp16 (q and k_cache of one dtype; out in it, lse
  fp32), one KV head, head_dim_v (dv) in {64, 128, 256, 512} and head_dim
  d = dv + rope with rope in {8, 16, 32, 64} (DeepSeek: 576 = 512 + 64).
  On sm_90a builds on Hopper GPUs every dv, with shared or per-head rope
  keys, runs the Hopper (wgmma) kernel (dv 64 on its dv 128 instance); the
  portable tile-MMA kernel (mma.sync / MFMA) runs every shape on AMD.
- Per-head rope keys (MHA2MLA; beyond FlashMLA): pass
  ``kpe_cache=[num_blocks, page_block_size, h_q, rope]`` (the same pages as
  k_cache, which then holds the dv latent columns alone). The score of head
  h is q[..., :dv] . c_t + q[..., dv:] . kpe_cache[t, h]; the rope parts are
  computed first into an fp32 workspace of b * s_q * h_q * capacity floats.
"""

from __future__ import annotations

import threading
import warnings

import torch

from . import kernel_choice
from ._ext import require_kernels
from .attention import _kv_scale, check_attention_shape, check_paged_rows
from .fp8 import FP8_DTYPES, FP8_KV_DTYPE

__all__ = ["get_mla_metadata", "flash_mla_with_kvcache"]



def get_mla_metadata(cache_seqlens: torch.Tensor, num_heads_per_head_k: int, num_heads_k: int):
    """cache_seqlens: [b] int32 on the GPU; num_heads_per_head_k = s_q * h_q // h_kv;
    num_heads_k = h_kv (1 for MLA).

    Returns (tile_scheduler_metadata, num_splits): the device-side split plan
    for these lengths (int32, opaque, [n] with n depending on b and the
    device's SM count) and num_splits [b + 1] int32, the cumulative number of
    splits per sequence (num_splits[i+1] - num_splits[i] splits for sequence
    i), as FlashMLA returns it."""
    _check_seqlens(cache_seqlens)
    require_kernels(cache_seqlens.device)
    if num_heads_k != 1:
        raise ValueError(f"num_heads_k must be 1 (MLA shares one latent KV head), got {num_heads_k}")
    if num_heads_per_head_k <= 0:
        raise ValueError(f"num_heads_per_head_k must be positive, got {num_heads_per_head_k}")
    # capacity is unknown here: plan against the lengths as given (the call
    # re-plans against its cache's capacity anyway)
    plan = torch.ops.mla_decode.plan(cache_seqlens, 1, int(num_heads_per_head_k), 2 ** 31 - 1)
    return plan, _num_splits(plan, cache_seqlens.shape[0])


def _num_splits(plan, b):
    """FlashMLA's num_splits [b + 1] (cumulative splits per sequence) from our plan's per-sequence split counts."""
    splits = plan[2:2 + 2 * b:2]
    return torch.cat([splits.new_zeros(1), torch.cumsum(splits, 0, dtype=torch.int32)])


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                           softmax_scale=None, causal=False, *, kpe_cache=None, check_block_table=False,
                           kv_scale=None):
    """q: [b, s_q, h_q, d] (d = head_dim_v + rope; DeepSeek 576);
    k_cache: [num_blocks, page_block_size, 1, d] (or [num_blocks,
    page_block_size, d]); block_table: [b, max_blocks] int32; cache_seqlens:
    [b] int32; head_dim_v: dv (DeepSeek 512); the metadata from
    get_mla_metadata; softmax_scale defaults to d ** -0.5; causal masks
    query token i (of s_q) to positions < L - (s_q - 1 - i).
    kpe_cache (keyword, optional): per-head rope keys [num_blocks,
    page_block_size, h_q, d - dv]; k_cache's last dimension is then dv.
    Block ids: an id outside [0, num_blocks) in a slot a sequence uses is
    read as block 0 (never outside k_cache; that sequence's output is then
    unspecified). Lengths: one above the block table's max_blocks *
    page_block_size rows is held to it, and a negative one reads as 0 (out
    0, lse -inf): no row outside a sequence's block-table row is read.
    check_block_table=True (keyword)
    checks the lengths (within [0, max_blocks * page_block_size]) and the
    used slots first and raises ValueError naming the first bad one (a host
    synchronization: a debugging mode, not for the hot path).
    kv_scale (keyword; ours, FlashMLA's dense decode has no FP8): with
    k_cache in ``mla_decode.fp8.FP8_KV_DTYPE`` (vLLM's per-tensor FP8 MLA
    cache), its scale, as ``mla_attention``'s; bf16 q, d 576. On Hopper,
    pages of a multiple of 64 rows run the Hopper kernel's fp8 instances,
    which take the metadata's plan; other page sizes the portable kernel's,
    which plans its own split in the call (the metadata is made for the
    Hopper kernel's split).

    Returns (out [b, s_q, h_q, dv] in q's dtype, lse [b, h_q, s_q] fp32)."""
    if q.dim() != 4:
        raise ValueError(f"q must have shape [b, s_q, h_q, d], got {list(q.shape)}")
    d = q.shape[-1]
    check_attention_shape(d, head_dim_v)
    require_kernels(q.device)
    fp8 = k_cache.dtype in FP8_DTYPES
    if fp8 and (q.dtype != torch.bfloat16 or k_cache.dtype != FP8_KV_DTYPE):
        raise TypeError(f"an fp8 k_cache must be {FP8_KV_DTYPE} with bfloat16 q, got {k_cache.dtype} and {q.dtype}")
    if not fp8 and (q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype):
        raise TypeError(f"q and k_cache must both be bfloat16 or both float16 (or k_cache {FP8_KV_DTYPE} with "
                        f"kv_scale), got {q.dtype} and {k_cache.dtype}")
    scale = _kv_scale(k_cache, kv_scale)  # (required with an fp8 cache, refused without one)
    width = head_dim_v if kpe_cache is not None else d
    if k_cache.dim() == 4 and k_cache.shape[2] != 1:
        raise ValueError(f"k_cache must hold one KV head: [num_blocks, page_block_size, 1, {width}], "
                         f"got {list(k_cache.shape)}")
    if block_table is None:
        raise ValueError("block_table is required ([b, max_blocks_per_seq] int32)")
    b = q.shape[0]
    _check_seqlens(cache_seqlens)
    if num_splits.dtype != torch.int32 or num_splits.shape != (b + 1,) or num_splits.device != q.device:
        raise ValueError(f"num_splits must be int32 [b + 1] = [{b + 1}] on {q.device} (from get_mla_metadata), "
                         f"got {num_splits.dtype} {list(num_splits.shape)} on {num_splits.device}")
    if (tile_scheduler_metadata.dtype != torch.int32 or tile_scheduler_metadata.dim() != 1
            or tile_scheduler_metadata.device != q.device):
        raise ValueError("tile_scheduler_metadata must be the int32 tensor get_mla_metadata returned, got "
                         f"{tile_scheduler_metadata.dtype} {list(tile_scheduler_metadata.shape)} on "
                         f"{tile_scheduler_metadata.device}")
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if check_block_table:
        check_paged_rows(block_table, cache_seqlens, k_cache.shape[0], k_cache.shape[1],
                         ("block_table", "cache_seqlens", "k_cache"))
    args = (q, k_cache, cache_seqlens, block_table, None, float(softmax_scale), bool(causal), None, int(head_dim_v),
            kpe_cache)
    # the metadata's plan where the kernel that runs splits the work as get_mla_metadata plans it: the bf16 kernel's
    # shape, and fp8 caches in pages of a multiple of 64 rows on Hopper (the Hopper kernel's fp8 instances); other
    # fp8 calls run the portable kernel, which plans in the call
    if fp8:
        tail, use_meta = (True, scale), k_cache.shape[1] % 64 == 0 and kernel_choice.hopper(q.device)  # (split, kv_scale)
    else:
        tail, use_meta = (), kpe_cache is None and head_dim_v == 512 and d == 576
    if use_meta:
        try:  # its plan, with the lengths read now and a work counter of this call's own
            return torch.ops.mla_decode.attention(*args, tile_scheduler_metadata, *tail)
        except ValueError as e:
            if not str(e).startswith("plan"):  # (a plan of other sizes: this call plans its own)
                raise
            _warn_other_sizes(q, str(e))
    return torch.ops.mla_decode.attention(*args, None, *tail)


_warned_sizes = set()
_warned_lock = threading.Lock()


def _warn_other_sizes(q, why):
    """Say once per (device, b, s_q, h_q) that the metadata passed does not fit the call (a slow path)."""
    key = (q.device, q.shape[0], q.shape[1], q.shape[2])
    with _warned_lock:
        if key in _warned_sizes:
            return
        _warned_sizes.add(key)
    warnings.warn(f"flash_mla_with_kvcache: tile_scheduler_metadata was made for other sizes than this call's "
                  f"(b {q.shape[0]}, s_q {q.shape[1]}, h_q {q.shape[2]}): {why.splitlines()[0]}; such calls plan "
                  f"their own split (one more launch and a refused attempt each). Make the metadata with "
                  f"get_mla_metadata(cache_seqlens, s_q * h_q, 1).", RuntimeWarning, stacklevel=3)


def _check_seqlens(cache_seqlens):
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1:
        raise TypeError("cache_seqlens must be an int32 tensor [b], got "
                        f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens))} "
                        f"{list(getattr(cache_seqlens, 'shape', []))}")
    if not cache_seqlens.is_cuda:
        raise ValueError(f"cache_seqlens must be on the GPU, got {cache_seqlens.device}")
