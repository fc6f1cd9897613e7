"""The projection stages of a decode step (pipeline steps 1-3 and 6 of the
README), on the task's weights as the caller passes them.

The matrix products are the vendor BLAS through PyTorch (cuBLAS on NVIDIA,
hipBLASLt/rocBLAS on AMD); ``benchmarks/bench_projections.py`` measures each
stage. What this module adds is the layout: every product writes where the
next stage reads, so nothing is copied between stages:

- ``down``: q_lora = x W_qd^T and the new latent row x W_kvd^T.
- ``query``: q = q_lora W_qu^T; q_nope absorbed through W_UK straight into
  the attention's query buffer ``qbuf`` [H, bs, r + rope] (columns 0..r-1).
  Returns q_pe (un-rotated).
- ``rope_append``: q_pe rotated at the new row's position into ``qbuf``'s
  last rope columns, and the new latent row written into the cache at that
  position; the position is read on the device (seqlens - 1), so a captured
  graph serves every step. The GPU kernel (torch.ops.mla_decode.rope_append)
  or its PyTorch twin; both give the same bits.
- ``output``: o [bs, H, r] through W_UV per head into ``obuf`` [bs, H, v]
  (written through a [H, bs, v] view), then wo into ``y`` [bs, dim].

The attention reads ``qbuf`` as [bs, 1, H, r + rope] with strides
(r + rope, -, bs * (r + rope), 1). Rounding is the task's: every product is
a bf16 GEMM (fp32 accumulation, bf16 result); RoPE is the task's
rotate-half in bf16, each product and the sum rounded.
"""

from __future__ import annotations

import torch

from .reference import rope_rotate

__all__ = ["down", "query", "rope_append", "output", "stage_weight_bytes"]


def down(x2, w_qd, w_kvd):
    """x2 [bs, dim] -> (q_lora [bs, q_lora], kv_new [bs, r + rope]): two
    products on the weights where they lie (a concatenated weight would read
    x once and launch once, 19 vs 27 us at bs=128 on the H200, but costs a
    30 MB copy per weight set, and the task's ranked mode passes new weight
    objects on every call)."""
    return torch.mm(x2, w_qd.t()), torch.mm(x2, w_kvd.t())


def query(q_lora, w_qu, w_uk, qbuf):
    """q_lora [bs, q_lora]; w_qu [H*(nope+rope), q_lora]; w_uk [H, nope, r]
    (a view of W_kv_up); qbuf [H, bs, r + rope]: columns 0..r-1 are written.
    Returns q_pe [bs, H, rope] (un-rotated, a view of the up-projection)."""
    H, nope, r = w_uk.shape
    bs = q_lora.shape[0]
    q = torch.mm(q_lora, w_qu.t()).view(bs, H, -1)
    torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk, out=qbuf[:, :, :r])
    return q[:, :, nope:]


def rope_append(q_pe, kv_new, seqlens, tables, qbuf, cache, kernel=True, kpe=None):
    """Rotate q_pe [bs, H, rope] at position seqlens[b] - 1 into qbuf[:, :,
    r:] and write kv_new [bs, r + rope] into cache[b, seqlens[b] - 1].
    tables = (rope_cs [P, rope] cos|sin as the kernels take it, cos2, sin2
    [P, rope] in the [a, a] layout). With ``kpe`` [bs, >= max_seq_len,
    rope], the new row's k_pe rotated at its position goes to kpe[b, pos]
    (the decoder's rotated copy of the cache's keys). Returns the
    attention's query view of qbuf, [bs, 1, H, r + rope]."""
    rope = q_pe.shape[-1]
    q_out = qbuf[:, :, qbuf.shape[-1] - rope:].transpose(0, 1)
    if kernel:
        torch.ops.mla_decode.rope_append(q_pe, kv_new, seqlens, tables[0], q_out, cache, kpe)
    else:
        pos = seqlens.to(torch.int64) - 1
        cos, sin = tables[1][pos].unsqueeze(1), tables[2][pos].unsqueeze(1)
        q_out.copy_(rope_rotate(q_pe, cos, sin))
        rows = torch.arange(cache.shape[0], device=cache.device)
        cache[rows, pos] = kv_new
        if kpe is not None:
            kpe[rows, pos] = rope_rotate(kv_new[:, None, -rope:], cos, sin)[:, 0]
    return qbuf.transpose(0, 1).unsqueeze(1)


def output(o_lat, w_uv_t, w_o, obuf, y):
    """o_lat [bs, H, r] (any strides with a unit last one); w_uv_t [H, r, v]
    (a view of W_kv_up); w_o [dim, H*v]; obuf [bs, H, v] and y [bs, dim]
    are written. Returns y."""
    torch.bmm(o_lat.transpose(0, 1), w_uv_t, out=obuf.transpose(0, 1))
    bs, H, v = obuf.shape
    return torch.mm(obuf.view(bs, H * v), w_o.t(), out=y)


def stage_weight_bytes(dims):
    """Weight bytes each stage must read (bf16): the numerator of its GB/s."""
    H, nope, rope, v, r = dims.heads, dims.nope, dims.rope, dims.v, dims.kv_lora
    return dict(
        down=2 * dims.dim * (dims.q_lora + r + rope),
        query=2 * (H * (nope + rope) * dims.q_lora + H * nope * r),
        output=2 * (H * v * r + dims.dim * H * v),
    )
