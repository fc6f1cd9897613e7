"""The projection stages of a decode step (pipeline steps 1-3 and 6 of
docs/architecture.md) as separate functions, on the task's weights as the
caller passes them: the PyTorch fallback's step, and what the stage
benchmarks and tests measure. (The kernel path runs the same stages from C++
in one call: mla_decode._C.decode_step.)

Which GEMM runs each product is mla_decode.kernel_choice's decision
(``gemm_path``, ``query_path``, ``blas_lt_path`` say which and why). Every
product writes where the next stage reads, so nothing is copied between
stages:

- ``down``: q_lora = x W_qd^T and the new latent row x W_kvd^T.
- ``query``: q = q_lora W_qu^T; q_nope absorbed through W_UK straight into
  the attention's query buffer ``qbuf`` [H, bs, r + rope] (columns 0..r-1).
  Returns q_pe (un-rotated). One launch of the fused Hopper query where
  ``query_path`` says so, else two vendor products.
- ``rope_append``: q_pe rotated at the new row's position into ``qbuf``'s
  last rope columns, and the new latent row written into the cache at that
  position (read on the device: seqlens - 1). The GPU kernel or its PyTorch
  twin; both give the same bits.
- ``output``: o [bs, H, r] through W_UV per head into ``obuf`` [bs, H, v],
  then wo into ``y`` [bs, dim] (cuBLASLt where ``blas_lt_path`` says so).

Each runs without autograd (the weights may be nn.Parameters; the outputs
are written in place).

The attention reads ``qbuf`` as [bs, 1, H, r + rope] with strides
(r + rope, -, bs * (r + rope), 1). Rounding is the task's: every product is
a bf16 GEMM (fp32 accumulation, bf16 result); RoPE is the task's
rotate-half in bf16, each product and the sum rounded.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from . import _ext
from .kernel_choice import blas_lt_path, gemm_path, query_path
from .reference import rope_rotate

__all__ = ["down", "query", "query_path", "rope_append", "output", "stage_weight_bytes", "gemm", "gemm_path", "blas_lt_path",
           "GemmConfig", "gemm_config"]


class GemmConfig(NamedTuple):
    """The Hopper GEMM launcher's choice for a product (``gemm_config``;
    csrc/kernels/projections/gemm.h): tile columns and rows, split-K
    ways (the cluster size), pipeline stages, blocks, shared memory bytes per
    block, the load group (k blocks requested back to back) and the fp32
    split-K workspace bytes (0 without splits)."""
    bn: int
    bm: int
    splits: int
    stages: int
    blocks: int
    smem: int
    group: int
    ws_bytes: int


def gemm_config(x, w, y, w1=None, y1=None) -> GemmConfig:
    """What ``gemm`` on the Hopper GEMM would launch for these operands, by
    name (the op ``torch.ops.mla_decode.gemm_nt_config`` returns the same
    numbers as a list, in this order); ValueError naming why where the Hopper
    GEMM does not take them."""
    return GemmConfig(*torch.ops.mla_decode.gemm_nt_config(x, w, y, w1, y1))


@torch.no_grad()
def gemm(x, w, y, w1=None, y1=None, pdl=True, lt=False, own=False):
    """y = x w^T (and y1 = x w1^T, the same x read once), bf16, fp32
    accumulation, into y (and y1) as given. x [m, k] or [batch, m, k], w [n,
    k] or [batch, n, k] (any row strides, unit last stride). pdl: the Hopper
    GEMM launches as a programmatic dependent (its weights stream while the
    previous kernel ends). lt: on the vendor path, run 2-D products on
    cuBLASLt (where blas_lt_path says it can; a per-call choice, nothing
    process-wide). own: this product takes our Hopper GEMM by default
    (``gemm_path``)."""
    if gemm_path(x, w, y, own) == "sm90" and (w1 is None or gemm_path(x, w1, y1, own) == "sm90"):
        torch.ops.mla_decode.gemm_nt(x, w, y, w1, y1, None, pdl)
        return
    for ww, yy in ((w, y), (w1, y1)):
        if ww is None:
            continue
        if x.dim() == 2:
            if not (lt and blas_lt_path(x) and ww.dtype == torch.bfloat16 and _ext.module().gemm_nt_lt(x, ww, yy)):
                torch.mm(x, ww.t(), out=yy)
        else:
            torch.bmm(x, ww.transpose(1, 2), out=yy)


@torch.no_grad()
def down(x2, w_qd, w_kvd):
    """x2 [bs, dim] -> (q_lora [bs, q_lora], kv_new [bs, r + rope]): both
    products on the weights where they lie (no concatenated copy: the task's
    ranked mode passes new weight objects on every call); one launch on the
    Hopper GEMM, two on the vendor's (the second vendor product on a forked
    stream, as a graph branch, saved nothing: docs/not_kept.md)."""
    bs = x2.shape[0]
    q_lora = torch.empty(bs, w_qd.shape[0], dtype=x2.dtype, device=x2.device)
    kv_new = torch.empty(bs, w_kvd.shape[0], dtype=x2.dtype, device=x2.device)
    gemm(x2, w_qd, q_lora, w_kvd, kv_new, own=True)
    return q_lora, kv_new


@torch.no_grad()
def query(q_lora, w_qu, w_uk, qbuf, path=None):
    """q_lora [bs, q_lora]; w_qu [H*(nope+rope), q_lora]; w_uk [H, nope, r]
    (a view of W_kv_up); qbuf [H, bs, r + rope]: columns 0..r-1 are written.
    Returns q_pe [bs, H, rope] (un-rotated): a buffer of its own from the
    fused query (``query_path``), else a view of the up-projection.
    ``path``: what ``query_path`` said for these operands, when the caller
    has asked it already."""
    H, nope, r = w_uk.shape
    bs = q_lora.shape[0]
    if (path or query_path(q_lora, w_qu, w_uk, qbuf)) == "sm90":
        q_pe = torch.empty(bs, H, w_qu.shape[0] // H - nope, dtype=q_lora.dtype, device=q_lora.device)
        torch.ops.mla_decode.query_fused(q_lora, w_qu, w_uk, qbuf[:, :, :r], q_pe, True)
        return q_pe
    q = torch.empty(bs, w_qu.shape[0], dtype=q_lora.dtype, device=q_lora.device)
    gemm(q_lora, w_qu, q)
    q = q.view(bs, H, -1)
    torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk, out=qbuf[:, :, :r])
    return q[:, :, nope:]


@torch.no_grad()
def query_rope_append(q_lora, w_qu, w_uk, kv_new, seqlens, tables, qbuf, cache, kernel=True, kpe=None):
    """``query`` then ``rope_append`` (same arguments; the attention's query
    view of qbuf returned): one launch of the fused Hopper query where
    ``query_path`` says "sm90" (it rotates q_pe as it stores it and writes the
    cache row and its rotated k_pe itself, which takes the separate
    RoPE/append kernel off the step's critical path: docs/projections.md),
    else the two stages as they are."""
    r = w_uk.shape[2]
    path = query_path(q_lora, w_qu, w_uk, qbuf) if kernel else None
    if path == "sm90":
        cs, _, _ = tables
        torch.ops.mla_decode.query_fused(q_lora, w_qu, w_uk, qbuf[:, :, :r], _rope_out(qbuf, qbuf.shape[-1] - r), True,
                                         kv_new, seqlens, cs, cache, kpe)
        return _attention_query(qbuf)
    q_pe = query(q_lora, w_qu, w_uk, qbuf, path=path)
    return rope_append(q_pe, kv_new, seqlens, tables, qbuf, cache, kernel=kernel, kpe=kpe)


@torch.no_grad()
def rope_append(q_pe, kv_new, seqlens, tables, qbuf, cache, kernel=True, kpe=None):
    """Rotate q_pe [bs, H, rope] at position seqlens[b] - 1 into qbuf[:, :,
    r:] and write kv_new [bs, r + rope] into cache[b, seqlens[b] - 1].
    tables = (rope_cs [P, rope] cos|sin as the kernels take it, cos2, sin2
    [P, rope] in the [a, a] layout). With ``kpe`` [bs, >= max_seq_len,
    rope], the new row's k_pe rotated at its position goes to kpe[b, pos]
    as well (for a caller keeping its keys' rope part apart, rotated). A
    sequence whose position is outside the cache or the tables (seqlens[b]
    of 0, or past max_seq_len) is skipped, its qbuf and cache rows left as
    they were, by the kernel and by its PyTorch twin alike. Returns the
    attention's query view of qbuf, [bs, 1, H, r + rope]."""
    rope = q_pe.shape[-1]
    q_out = _rope_out(qbuf, rope)
    cs, cos2, sin2 = tables
    if kernel:
        torch.ops.mla_decode.rope_append(q_pe, kv_new, seqlens, cs, q_out, cache, kpe)
    else:
        # (the kernel's skip, without a host synchronisation: positions clamped for the gathers, the
        # skipped sequences' old values written back)
        pos = seqlens.to(torch.int64) - 1
        limit = min(cache.shape[1], cos2.shape[0])
        if limit == 0:  # (no position fits: every sequence skipped)
            return _attention_query(qbuf)
        ok = (pos >= 0) & (pos < limit)
        pos = pos.clamp(0, limit - 1)
        cos, sin = cos2[pos].unsqueeze(1), sin2[pos].unsqueeze(1)
        q_out.copy_(torch.where(ok[:, None, None], rope_rotate(q_pe, cos, sin), q_out))
        rows = torch.arange(cache.shape[0], device=cache.device)
        new = torch.where(ok[:, None], kv_new.to(cache.dtype), cache[rows, pos])
        with writable(cache):
            cache[rows, pos] = new
        if kpe is not None:
            new = torch.where(ok[:, None], rope_rotate(kv_new[:, None, -rope:], cos, sin)[:, 0].to(kpe.dtype),
                              kpe[rows, pos])
            with writable(kpe):
                kpe[rows, pos] = new
    return _attention_query(qbuf)


def writable(t):
    """A context in which PyTorch may write ``t`` in place: inference mode
    where t was made under it (an inference tensor, which only inference
    mode may update; the kernels write it through its pointer in any mode),
    else the caller's mode as it is. Only the in-place write runs inside, so
    the outputs are ordinary tensors either way."""
    return torch.inference_mode() if t.is_inference() else contextlib.nullcontext()


def _rope_out(qbuf, rope):
    """The rotated q_pe's place in qbuf [H, bs, r + rope]: [bs, H, rope]."""
    return qbuf[:, :, qbuf.shape[-1] - rope:].transpose(0, 1)


def _attention_query(qbuf):
    """The attention's query view of qbuf [H, bs, r + rope]: [bs, 1, H, r + rope]."""
    return qbuf.transpose(0, 1).unsqueeze(1)


@torch.no_grad()
def output(o_lat, w_uv_t, w_o, obuf, y):
    """o_lat [bs, H, r] (any strides with a unit last one); w_uv_t [H, r, v]
    (a view of W_kv_up); w_o [dim, H*v]; obuf [bs, H, v] and y [bs, dim]
    are written. Returns y."""
    gemm(o_lat.transpose(0, 1), w_uv_t.transpose(1, 2), obuf.transpose(0, 1))
    bs, H, v = obuf.shape
    gemm(obuf.view(bs, H * v), w_o, y, lt=True)  # (cuBLASLt: docs/projections.md)
    return y


def stage_weight_bytes(dims):
    """Weight bytes each stage must read (bf16): the numerator of its GB/s."""
    H, nope, rope, v, r = dims.heads, dims.nope, dims.rope, dims.v, dims.kv_lora
    return dict(
        down=2 * dims.dim * (dims.q_lora + r + rope),
        query=2 * (H * (nope + rope) * dims.q_lora + H * nope * r),
        output=2 * (H * v * r + dims.dim * H * v),
    )
