"""The projection stages of a decode step (pipeline steps 1-3 and 6 of the
README), on the task's weights as the caller passes them.

The products run on the vendor BLAS through PyTorch (cuBLAS; hipBLASLt or
rocBLAS on AMD); on NVIDIA the wo product asks PyTorch for cuBLASLt while it
is enqueued (``gemm(..., lt=True)``; measured on an H200 at bs 128: 62.1
against 69.3 us, 90% of copy bandwidth; the other products are no faster
there; MLA_DECODE_BLASLT=0 turns it off). Our Hopper skinny GEMM
(torch.ops.mla_decode.gemm_nt: wgmma + TMA, split-K in a thread-block
cluster) runs the down stage's two products in one launch on a Hopper
build on a Hopper GPU (measured on an H200 at bs 128: 20.5 against cuBLAS's
22.5 us for its two products; the decode step's graph 4-6 us faster); it
is slower than cuBLAS for the other products (README), which take it only
with MLA_DECODE_GEMM=sm90 (=vendor puts every product on the vendor BLAS).
``gemm_path`` says which runs and why.
``benchmarks/bench_projections.py`` measures each stage both ways. Every
product writes where the next stage reads, so nothing is copied between
stages:

- ``down``: q_lora = x W_qd^T and the new latent row x W_kvd^T, the weights
  where they lie.
- ``query``: q = q_lora W_qu^T; q_nope absorbed through W_UK straight into
  the attention's query buffer ``qbuf`` [H, bs, r + rope] (columns 0..r-1).
  Returns q_pe (un-rotated). On Hopper, one launch of our fused query
  kernel where ``query_path`` says so (q stays in registers), else the two
  vendor products.
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

import contextlib
import os

import torch

from . import _ext
from .reference import rope_rotate

__all__ = ["down", "query", "query_path", "rope_append", "output", "stage_weight_bytes", "gemm", "gemm_path", "blas_lt_path"]

_HOPPER = {}  # device index -> the Hopper kernels run there (a Hopper build on a Hopper GPU)


def _hopper(device) -> bool:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _HOPPER:
        try:
            _HOPPER[idx] = _ext.module().attention_info(idx)[7] == 1
        except RuntimeError:
            _HOPPER[idx] = False
    return _HOPPER[idx]


_SMS = {}  # device index -> multiprocessor count


def _sm_count(device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _aligned(t) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1])


def _hopper_unusable(device, tensors, what):
    """Why our Hopper kernel `what` cannot run on these bf16 operands here
    ("vendor: ..."), or None: the checks the GEMM and the fused query share."""
    if not _ext.kernels_usable(device):
        return "vendor: " + _ext.backend(device)
    if not _hopper(device):
        return f"vendor: the {what} is Hopper-only (sm_90a build on a compute 9.x GPU)"
    if any(t.dtype != torch.bfloat16 for t in tensors):
        return "vendor: bf16 only"
    return None


def gemm_path(x, w, y=None, own=False) -> str:
    """"sm90" when ``gemm`` runs x w^T on our Hopper GEMM, else "vendor: why".
    MLA_DECODE_GEMM=sm90: every product on the Hopper GEMM where it runs;
    =vendor: every product on the vendor BLAS; unset: the products that ask
    for ours (``own``: the down stage) on it, the others on the vendor's.
    (The variable is read on every call, not once, so that tests and
    benchmarks can switch it at run time; a captured step replays with no
    Python, so the read costs only eager calls and captures.)"""
    mode = os.environ.get("MLA_DECODE_GEMM")
    if mode == "vendor":
        return "vendor: MLA_DECODE_GEMM=vendor"
    if mode != "sm90" and not own:
        return "vendor: the default for this product (MLA_DECODE_GEMM=sm90 puts every product on the Hopper GEMM)"
    why = _hopper_unusable(x.device, (x, w), "skinny GEMM")
    if why is not None:
        return why
    m, n = x.shape[-2], w.shape[-2]
    if not 1 <= m <= 256:
        return f"vendor: {m} rows of x (the Hopper GEMM takes 1 to 256)"
    if n < 64 or n % 8:
        return f"vendor: {n} output columns (the Hopper GEMM takes multiples of 8, at least 64)"
    if not all(_aligned(t) for t in (x, w) + ((y,) if y is not None else ())):
        return "vendor: operands not 16-byte aligned (base and strides)"
    return "sm90"


def blas_lt_path(x) -> bool:
    """True when ``gemm(..., lt=True)`` asks PyTorch for cuBLASLt: a CUDA
    build of PyTorch that lets the caller choose its BLAS library, x on the
    GPU, and MLA_DECODE_BLASLT not 0."""
    return (x.is_cuda and torch.version.cuda is not None and os.environ.get("MLA_DECODE_BLASLT") != "0"
            and hasattr(torch.backends.cuda, "preferred_blas_library"))


@contextlib.contextmanager
def _prefer_cublaslt():
    """PyTorch's preferred BLAS library set to cuBLASLt for the products
    enqueued inside, then set back to what it was. (The setting is
    process-wide: a product another thread enqueues meanwhile may run on
    cuBLASLt too; PyTorch prints once that the setting is experimental.)"""
    be = torch.backends.cuda
    prev = be.preferred_blas_library()
    if str(prev).lower().endswith("cublaslt"):
        yield
        return
    be.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        be.preferred_blas_library(prev)


def gemm(x, w, y, w1=None, y1=None, pdl=True, lt=False, own=False):
    """y = x w^T (and y1 = x w1^T, the same x read once), bf16, fp32
    accumulation, into y (and y1) as given. x [m, k] or [batch, m, k], w [n,
    k] or [batch, n, k] (any row strides, unit last stride). pdl: the Hopper
    GEMM launches as a programmatic dependent (its weights stream while the
    previous kernel ends). lt: on the vendor path, ask PyTorch for cuBLASLt
    (where blas_lt_path says it can). own: this product takes our Hopper GEMM
    by default (``gemm_path``)."""
    if gemm_path(x, w, y, own) == "sm90" and (w1 is None or gemm_path(x, w1, y1, own) == "sm90"):
        torch.ops.mla_decode.gemm_nt(x, w, y, w1, y1, None, pdl)
        return
    with _prefer_cublaslt() if lt and blas_lt_path(x) else contextlib.nullcontext():
        for ww, yy in ((w, y), (w1, y1)):
            if ww is None:
                continue
            if x.dim() == 2:
                torch.mm(x, ww.t(), out=yy)
            else:
                torch.bmm(x, ww.transpose(1, 2), out=yy)


def down(x2, w_qd, w_kvd):
    """x2 [bs, dim] -> (q_lora [bs, q_lora], kv_new [bs, r + rope]): both
    products on the weights where they lie (no concatenated copy: the task's
    ranked mode passes new weight objects on every call); one launch on the
    Hopper GEMM, two on the vendor's. (Measured on the H200: the second
    vendor product on a forked stream, as a graph branch, saved nothing.)"""
    bs = x2.shape[0]
    q_lora = torch.empty(bs, w_qd.shape[0], dtype=x2.dtype, device=x2.device)
    kv_new = torch.empty(bs, w_kvd.shape[0], dtype=x2.dtype, device=x2.device)
    gemm(x2, w_qd, q_lora, w_kvd, kv_new, own=True)
    return q_lora, kv_new


def query_path(q_lora, w_qu, w_uk, qbuf) -> str:
    """"sm90" when ``query`` runs as one launch of our Hopper fused query
    (torch.ops.mla_decode.query_fused: q_lora W_qu^T and the W_UK absorption
    per head, one block per head, q never through memory), else "vendor:
    why" (two vendor products). The default on a Hopper build on a Hopper
    GPU with at least 3/4 as many heads as SMs (measured on an H200, 132
    SMs: 128 heads 28.3 / 29.5 / 33.8 us against 30.3 / 30.5 / 35.7 at bs 1 /
    32 / 128; 64 heads, half the SMs idle, 23.9 against 22.4 at bs 128);
    MLA_DECODE_GEMM=vendor turns it off."""
    if os.environ.get("MLA_DECODE_GEMM") == "vendor":
        return "vendor: MLA_DECODE_GEMM=vendor"
    why = _hopper_unusable(q_lora.device, (q_lora, w_qu, w_uk, qbuf), "fused query")
    if why is not None:
        return why
    H, nope, r = w_uk.shape
    rope = w_qu.shape[0] // H - nope
    if (nope, rope) != (128, 64) or r % 128:
        return f"vendor: heads of {nope} nope + {rope} rope columns, r {r} (the fused query takes 128 + 64, r a multiple of 128)"
    if not 1 <= q_lora.shape[0] <= 128:
        return f"vendor: {q_lora.shape[0]} rows of q_lora (the fused query takes 1 to 128)"
    sms = _sm_count(q_lora.device)
    if 4 * H < 3 * sms:
        return f"vendor: {H} heads on {sms} SMs (the fused query runs one block per head: at least 3/4 of the SMs)"
    if not all(_aligned(t) for t in (q_lora, w_qu, w_uk, qbuf)):
        return "vendor: operands not 16-byte aligned (bases and strides of q_lora, the weights and qbuf)"
    return "sm90"


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


def query_rope_append(q_lora, w_qu, w_uk, kv_new, seqlens, tables, qbuf, cache, kernel=True, kpe=None):
    """``query`` then ``rope_append`` (same arguments; the attention's query
    view of qbuf returned): one launch of the fused Hopper query where
    ``query_path`` says "sm90" (it rotates q_pe as it stores it and writes the
    cache row and its rotated k_pe itself; measured on an H200: the separate
    RoPE/append kernel took ~4.7 us of the step's critical path), else the
    two stages as they are."""
    r = w_uk.shape[2]
    path = query_path(q_lora, w_qu, w_uk, qbuf) if kernel else None
    if path == "sm90":
        torch.ops.mla_decode.query_fused(q_lora, w_qu, w_uk, qbuf[:, :, :r], _rope_out(qbuf, qbuf.shape[-1] - r), True,
                                         kv_new, seqlens, tables[0], cache, kpe)
        return _attention_query(qbuf)
    q_pe = query(q_lora, w_qu, w_uk, qbuf, path=path)
    return rope_append(q_pe, kv_new, seqlens, tables, qbuf, cache, kernel=kernel, kpe=kpe)


def rope_append(q_pe, kv_new, seqlens, tables, qbuf, cache, kernel=True, kpe=None):
    """Rotate q_pe [bs, H, rope] at position seqlens[b] - 1 into qbuf[:, :,
    r:] and write kv_new [bs, r + rope] into cache[b, seqlens[b] - 1].
    tables = (rope_cs [P, rope] cos|sin as the kernels take it, cos2, sin2
    [P, rope] in the [a, a] layout). With ``kpe`` [bs, >= max_seq_len,
    rope], the new row's k_pe rotated at its position goes to kpe[b, pos]
    (the decoder's rotated copy of the cache's keys). Returns the
    attention's query view of qbuf, [bs, 1, H, r + rope]."""
    rope = q_pe.shape[-1]
    q_out = _rope_out(qbuf, rope)
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
    return _attention_query(qbuf)


def _rope_out(qbuf, rope):
    """The rotated q_pe's place in qbuf [H, bs, r + rope]: [bs, H, rope]."""
    return qbuf[:, :, qbuf.shape[-1] - rope:].transpose(0, 1)


def _attention_query(qbuf):
    """The attention's query view of qbuf [H, bs, r + rope]: [bs, 1, H, r + rope]."""
    return qbuf.transpose(0, 1).unsqueeze(1)


def output(o_lat, w_uv_t, w_o, obuf, y):
    """o_lat [bs, H, r] (any strides with a unit last one); w_uv_t [H, r, v]
    (a view of W_kv_up); w_o [dim, H*v]; obuf [bs, H, v] and y [bs, dim]
    are written. Returns y."""
    gemm(o_lat.transpose(0, 1), w_uv_t.transpose(1, 2), obuf.transpose(0, 1))
    bs, H, v = obuf.shape
    gemm(obuf.view(bs, H * v), w_o, y, lt=True)  # cuBLASLt: 10% faster than cuBLAS here (module docstring)
    return y


def stage_weight_bytes(dims):
    """Weight bytes each stage must read (bf16): the numerator of its GB/s."""
    H, nope, rope, v, r = dims.heads, dims.nope, dims.rope, dims.v, dims.kv_lora
    return dict(
        down=2 * dims.dim * (dims.q_lora + r + rope),
        query=2 * (H * (nope + rope) * dims.q_lora + H * nope * r),
        output=2 * (H * v * r + dims.dim * H * v),
    )
