"""FP8 latent-cache formats for serving (issue 33): how rows are quantized,
stored and appended, in PyTorch: the formats' definition, the append op in
PyTorch, and the dequantization that tests compare an FP8 attention
against. The attention (``mla_attention(..., kv_scale=)``) reads the
per-tensor format in ``FP8_KV_DTYPE``; no kernel reads the tiled one yet.

Two formats, both with the latent row [c (512) | k_pe (64)] of DeepSeek's
MLA:

- **Per-tensor** (vLLM's fp8 KV cache for MLA): every element of the cache
  is ``fp8(x / k_scale)``, one float ``k_scale`` for the whole cache; the
  row keeps its width d (576) in ``float8_e4m3fn`` (NVIDIA) or
  ``float8_e4m3fnuz`` (MI300X). Dequantized: ``stored * k_scale``.
- **Tiled** (DeepSeek-V3.2's 656-byte rows, FlashMLA's sparse decode): the
  512 latent values in 4 tiles of 128, each tile ``fp8(x / s_t)`` in
  ``float8_e4m3fn`` with its own fp32 scale ``s_t = max(amax_t, tiny) /
  448``, then the 4 scales (16 bytes, little-endian fp32), then the 64 rope
  values in bf16 (128 bytes): 512 + 16 + 128 = 656 bytes, stored as uint8.

Quantization clamps to the format's largest finite value (448 for e4m3fn,
240 for e4m3fnuz) before the cast, so an out-of-range value saturates
instead of becoming NaN; NaN stays NaN; the cast rounds to nearest even.
Error bound per element (both formats): ``|dequant(q(x)) - x| <=
max(2^-4 |x|, 2^-10 s)`` for ``|x| <= max_fp8 * s`` (3 mantissa bits;
below the smallest normal the absolute step is 2^-9 s), with s the
element's scale.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPES", "FP8_KV_DTYPE", "TILED_ROW_BYTES", "fp8_max", "quantize_per_tensor", "dequantize_per_tensor",
           "quantize_tiled", "dequantize_tiled", "fp8_append_paged"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# The per-tensor format the attention kernel reads (mla_attention's kv_scale):
# the platform's e4m3, float8_e4m3fnuz on ROCm builds (MI300X's hardware
# format), float8_e4m3fn elsewhere.
FP8_KV_DTYPE = torch.float8_e4m3fnuz if getattr(torch.version, "hip", None) else torch.float8_e4m3fn
LATENT, ROPE, TILE = 512, 64, 128
TILES = LATENT // TILE
TILED_ROW_BYTES = LATENT + 4 * TILES + 2 * ROPE  # 656


def fp8_max(dtype) -> float:
    """The largest finite value of an FP8 dtype of FP8_DTYPES."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    return float(torch.finfo(dtype).max)


def _scale_value(k_scale):
    s = float(k_scale.item() if isinstance(k_scale, torch.Tensor) else k_scale)
    if not (s > 0 and s != float("inf")):
        raise ValueError(f"k_scale must be a positive finite number, got {s}")
    return s


def quantize_per_tensor(x, k_scale, dtype=torch.float8_e4m3fn):
    """x (any float tensor) -> fp8(x / k_scale) in ``dtype``, saturated at
    the format's largest finite value; NaN stays NaN."""
    m = fp8_max(dtype)
    s = _scale_value(k_scale)
    if not x.is_floating_point():
        raise TypeError(f"x must be a float tensor, got {x.dtype}")
    return (x.float() / s).clamp(-m, m).to(dtype)


def dequantize_per_tensor(q, k_scale, dtype=torch.float32):
    """fp8 values -> q * k_scale in ``dtype``."""
    if q.dtype not in FP8_DTYPES:
        raise TypeError(f"q must be an fp8 tensor ({FP8_DTYPES}), got {q.dtype}")
    return (q.float() * _scale_value(k_scale)).to(dtype)


def quantize_tiled(rows):
    """rows [..., 576] (latent 512 | rope 64, any float dtype) -> uint8
    [..., 656]: four 128-value tiles of e4m3fn with their fp32 scales
    (amax / 448, at least tiny), then the rope values in bf16."""
    if rows.shape[-1] != LATENT + ROPE or not rows.is_floating_point():
        raise ValueError(f"rows must be float [..., {LATENT + ROPE}] (latent {LATENT} | rope {ROPE}), got "
                         f"{rows.dtype} {list(rows.shape)}")
    lead = rows.shape[:-1]
    lat = rows[..., :LATENT].float().reshape(*lead, TILES, TILE)
    # the tile's scale from its finite values: an infinity saturates (to +-448 s) and a NaN stays that
    # element's alone, as in the per-tensor format
    amax = lat.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().amax(dim=-1, keepdim=True)
    scale = torch.clamp(amax, min=torch.finfo(torch.float32).tiny) / 448.0
    q = (lat / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    out = torch.empty(*lead, TILED_ROW_BYTES, dtype=torch.uint8, device=rows.device)
    out[..., :LATENT] = q.reshape(*lead, LATENT).view(torch.uint8)
    out[..., LATENT:LATENT + 4 * TILES] = scale.reshape(*lead, TILES).contiguous().view(torch.uint8)
    out[..., LATENT + 4 * TILES:] = rows[..., LATENT:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def dequantize_tiled(packed, dtype=torch.float32):
    """uint8 [..., 656] -> [..., 576] in ``dtype`` (latent tiles times their
    scales, rope as stored)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] != TILED_ROW_BYTES:
        raise ValueError(f"packed must be uint8 [..., {TILED_ROW_BYTES}], got {packed.dtype} {list(packed.shape)}")
    lead = packed.shape[:-1]
    p = packed.contiguous()
    q = p[..., :LATENT].contiguous().view(torch.float8_e4m3fn).float().reshape(*lead, TILES, TILE)
    scale = p[..., LATENT:LATENT + 4 * TILES].contiguous().view(torch.float32).reshape(*lead, TILES, 1)
    rope = p[..., LATENT + 4 * TILES:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(q * scale).reshape(*lead, LATENT), rope], dim=-1).to(dtype)


def fp8_append_paged(k_cache, block_table, positions, rows, k_scale=None):
    """Quantize ``rows`` [b, 576] and write row i at position positions[i]
    of sequence i of a paged cache, in place: block block_table[i, pos //
    page], row pos % page. k_cache [num_blocks, page, (1,) 576] in an FP8
    dtype (per-tensor: ``k_scale`` required) or uint8 [num_blocks, page,
    (1,) 656] (tiled: no k_scale). positions [b] integers (on any device;
    read on the host; floats and bools raise TypeError). Nothing else of the
    cache is written. A position below 0, a block id outside [0, num_blocks)
    in a slot written, or two sequences naming one cache row raises
    ValueError before anything is written."""
    if k_cache.dim() == 4:
        if k_cache.shape[2] != 1:
            raise ValueError(f"k_cache must have one KV head, got {list(k_cache.shape)}")
        cache = k_cache[:, :, 0]
    elif k_cache.dim() == 3:
        cache = k_cache
    else:
        raise ValueError(f"k_cache must be [num_blocks, page, (1,) width], got {list(k_cache.shape)}")
    num_blocks, page, width = cache.shape
    if rows.dim() != 2 or rows.shape[1] != LATENT + ROPE or not rows.is_floating_point():
        raise ValueError(f"rows must be float [b, {LATENT + ROPE}], got {rows.dtype} {list(rows.shape)}")
    b = rows.shape[0]
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be int32 [b = {b}, max_blocks], got {block_table.dtype} "
                         f"{list(block_table.shape)}")
    pos = torch.as_tensor(positions)
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise TypeError(f"positions must be integers, got {pos.dtype}")
    pos = pos.to("cpu", torch.int64).reshape(-1)
    if pos.numel() != b:
        raise ValueError(f"positions must hold b = {b} values, got {pos.numel()}")
    if cache.dtype in FP8_DTYPES:
        if width != LATENT + ROPE:
            raise ValueError(f"a per-tensor fp8 cache has rows of {LATENT + ROPE}, got {width}")
        if k_scale is None:
            raise ValueError("k_scale is required for a per-tensor fp8 cache")
        q = quantize_per_tensor(rows, k_scale, cache.dtype)
    elif cache.dtype == torch.uint8:
        if width != TILED_ROW_BYTES:
            raise ValueError(f"a tiled cache has rows of {TILED_ROW_BYTES} bytes, got {width}")
        if k_scale is not None:
            raise ValueError("k_scale is for per-tensor caches; a tiled row carries its own scales")
        q = quantize_tiled(rows)
    else:
        raise TypeError(f"k_cache must be fp8 ({FP8_DTYPES}) or uint8 (tiled rows), got {cache.dtype}")
    if bool((pos < 0).any()):
        raise ValueError(f"positions must be non-negative, got {pos.tolist()}")
    slot = pos // page
    if bool((slot >= block_table.shape[1]).any()):
        raise ValueError(f"a position needs block-table slot {int(slot.max())}, the table has {block_table.shape[1]}")
    ids = block_table.cpu().to(torch.int64)[torch.arange(b), slot]
    bad = (ids < 0) | (ids >= num_blocks)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"sequence {i}: block id {int(ids[i])} at slot {int(slot[i])} is outside [0, {num_blocks})")
    target = ids * page + pos % page
    if target.unique().numel() != b:
        raise ValueError("two sequences' positions name the same cache row (block id, row); each row must be "
                         "written once")
    ids, r = ids.to(cache.device), (pos % page).to(cache.device)
    cache.view(torch.uint8)[ids, r] = q.to(cache.device).view(torch.uint8)  # (bytes: index_put has no fp8 kernels)
    return k_cache
