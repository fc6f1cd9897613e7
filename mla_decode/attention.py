"""The absorbed MQA decode attention over the latent cache, as an op.

Every query row attends over one shared latent row per position,
key = [c_t | k_pe_t] (d = dv + rope wide; DeepSeek: 576), value = c_t (dv
wide; DeepSeek: 512). Or, with per-head rope keys (MHA2MLA), key =
[c_t | k_pe_{t,h}] with c_t shared and k_pe per query head. mla_attention's
docstring is the contract; docs/attention.md describes the kernel.
"""

from __future__ import annotations

import torch

from ._ext import device_index, kernels_built, require_kernels
from .fp8 import FP8_DTYPES

__all__ = ["mla_attention", "mla_combine", "attention_reference", "rope_table", "check_attention_shape",
           "splits_possible", "SUPPORTED_DV", "SUPPORTED_ROPE"]

D, DV, ROPE = 576, 512, 64
SUPPORTED_DV = (64, 128, 256, 512)
SUPPORTED_ROPE = (8, 16, 32, 64)


def check_attention_shape(d: int, dv: int) -> int:
    """Raise ValueError unless the kernels are built for head dim ``d`` =
    dv + rope; returns the rope width. (The C++ op checks the same.)"""
    rope = d - dv
    if dv not in SUPPORTED_DV or rope not in SUPPORTED_ROPE:
        raise ValueError(
            f"unsupported attention shape: head dim d={d} with head_dim_v={dv} (rope width d - dv = {rope}); "
            f"supported: value width dv in {{64, 128, 256, 512}} with rope width in {{8, 16, 32, 64}}, the rope keys "
            f"either the last `rope` columns of the shared latent row (d = dv + rope) or per-head rope keys "
            f"[..., h_q, rope] beside a dv-wide latent cache")
    return rope


def rope_table(max_positions: int, rope: int = ROPE, device="cpu") -> torch.Tensor:
    """[max_positions, rope] bf16: cos of the rope/2 frequencies | sin of
    them, exactly as the task rounds them (mla_decode.reference.rope_cos_sin)."""
    from .reference import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(max_positions, device=device), rope)
    return torch.cat([cos[:, : rope // 2], sin[:, : rope // 2]], dim=-1).contiguous()


def plan_part_base(bs):
    """Where a plan's parts begin (int32 elements; plan.h's plan_part_base): after the 2-int header and
    2 ints per sequence, rounded up to 32 bytes. ``bs`` may be a symbolic size."""
    return (2 + 2 * bs + 7) // 8 * 8


def plan_elems(bs, s_q: int, h_q: int, split: bool, device):
    """The length (int32 elements) of ``torch.ops.mla_decode.plan(seqlens, s_q,
    h_q, capacity, split)`` for ``bs`` sequences on ``device``: plan.h's
    plan_size(bs, max_parts), max_parts = the target parts + bs (split) or bs.
    ``bs`` may be a symbolic size (a trace's)."""
    from ._ext import module

    require_kernels(device)
    idx = device_index(device)
    max_parts = (module().plan_target_parts(idx, s_q, h_q) + bs) if split else bs
    return plan_part_base(bs) + 8 * max_parts + 2


def splits_possible(bs: int, s_q: int, h_q: int, device) -> bool:
    """Whether the split planner can split a batch of ``bs`` sequences that
    all have ONE length (a decode step's). It cannot once bs is at least its
    target parts per head block (SMs x the kernel's blocks per SM / head
    blocks of s_q * h_q rows): every part size it weighs is then at least a
    sequence's tiles. Where it cannot, ``split=False`` gives the same plan
    and output and saves the combine's launch (the decode step does this)."""
    from ._ext import module

    require_kernels(device)
    idx = device_index(device)
    return module().splits_possible(idx, bs, s_q, h_q)


def mla_attention(q, kv, seqlens, softmax_scale, *, block_table=None, rope_cs=None, causal=False,
                  out=None, lse=None, kpe=None, head_dim_v=DV, kpe_heads=None, plan=None, split=True,
                  kv_scale=None):
    """Split-KV absorbed attention on the GPU kernels.

    q: [bs, s_q, h_q, d] bf16 or fp16 with d = head_dim_v + rope (DeepSeek:
    576 = 512 + 64; see SUPPORTED_DV / SUPPORTED_ROPE); kv: [bs, max_seq_len,
    d] (the task's cache) or, with ``block_table`` [bs, max_blocks] int32,
    pages [num_blocks, block_size, (1,) d]; seqlens: [bs] int32 on the device;
    softmax_scale: the scores' factor (None: d ** -0.5, as the serving API);
    rope_cs: None (keys used as stored) or ``rope_table(...)`` (the last rope
    key columns rotated at their position on the fly, the task's RoPE; bf16).
    kpe: None, or [bs, >= max_seq_len, rope] rows that replace the key's last
    rope columns (not with block_table), used as stored (for a caller that
    keeps its keys' rope part apart, already rotated).
    kpe_heads: None, or per-head rope keys (MHA2MLA) [bs, >= max_seq_len, h_q,
    rope] (paged: [num_blocks, block_size, h_q, rope], the pages of kv); kv
    rows are then the dv latent columns alone, and the score of head h is
    q[..., :dv] . c_t + q[..., dv:] . kpe_heads[t, h]. Used as stored.
    plan: None (the call plans its split on the device: one planner launch
    ahead of the attention), or ``torch.ops.mla_decode.plan(seqlens, s_q,
    h_q, capacity)`` made beforehand, as FlashMLA's ``get_mla_metadata``:
    one plan serves every call (e.g. every layer of a decode step), split
    best while the lengths in seqlens stay what they were when it was made,
    for the kernel configuration of dv 512 with the rope keys in the cache
    row (another configuration that splits differently raises).
    A plan of other lengths still gives the right outputs: each sequence's
    length is read from seqlens at the call (held to kv's capacity) and its
    last planned part runs to it, so a stale plan costs only balance. Calls
    sharing a plan may run on several streams at once (each call takes its
    work items from a counter of its own).
    split: True (default) lets the planner cut long sequences into parts,
    merged by a combine launch after the attention; False plans every
    sequence as one part and launches no combine (its plan, if passed, made
    with ``plan(..., split=False)``: the two kinds differ in size, and the
    wrong kind raises). Same output where the planner would not split
    anyway (``splits_possible``); slower where it would.
    Returns (out [bs, s_q, h_q, head_dim_v] in q's dtype, lse [bs, h_q, s_q]
    fp32, natural log). A sequence of length 0 gives out = 0 and lse = -inf;
    a negative length reads as 0, and one past kv's capacity (its rows, or
    the block table's) is held to it: no row outside a sequence's own is read.
    ``out``/``lse`` may be passed in (destination passing).
    kv_scale: with an FP8 cache (kv in ``mla_decode.fp8.FP8_KV_DTYPE``:
    e4m3fn on NVIDIA builds, e4m3fnuz on AMD; as ``mla_decode.fp8.
    quantize_per_tensor`` writes it), the cache's per-tensor scale: every
    stored value stands for value * kv_scale (required then; refused
    otherwise). A Python float, or a one-element tensor read with ``.item()``
    (a GPU tensor: a host sync per call, and refused during graph capture,
    where the scale is fixed when captured). FP8 takes bf16 q, d 576 / dv
    512 and the keys used as stored (no rope_cs, kpe or kpe_heads). On
    Hopper a dense cache or pages of a multiple of 64 rows run the Hopper
    kernel's fp8 instances, other pages (and other GPUs) the portable
    kernel's; a ``plan`` from the plan op is made for the bf16 kernel and is
    refused where the kernel that runs splits the work differently (the
    portable kernel on Hopper): pass none there."""
    check_attention_shape(q.shape[-1], head_dim_v)
    require_kernels(q.device)
    kv_scale = _kv_scale(kv, kv_scale)
    if (out is None) != (lse is None):
        raise ValueError("pass both out and lse, or neither")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if out is None:
        return torch.ops.mla_decode.attention(q, kv, seqlens, block_table, rope_cs, float(softmax_scale), bool(causal),
                                              kpe, int(head_dim_v), kpe_heads, plan, bool(split), kv_scale)
    torch.ops.mla_decode.attention_out(q, kv, seqlens, block_table, rope_cs, float(softmax_scale), bool(causal),
                                       out, lse, kpe, int(head_dim_v), kpe_heads, plan, bool(split), kv_scale)
    return out, lse


def _kv_scale(kv, kv_scale):
    """The op's kv_scale argument: the fp8 cache's scale (required), 1.0 otherwise (none may be given)."""
    if getattr(kv, "dtype", None) in FP8_DTYPES:
        if kv_scale is None:
            raise ValueError(f"kv is an fp8 cache ({kv.dtype}): pass kv_scale, the per-tensor scale it was "
                             "quantized with (mla_decode.fp8.quantize_per_tensor)")
        if isinstance(kv_scale, torch.Tensor):
            if kv_scale.numel() != 1:
                raise ValueError(f"kv_scale must be one number (the per-tensor scale), got a tensor of shape "
                                 f"{list(kv_scale.shape)}")
            if kv_scale.is_cuda and torch.cuda.is_current_stream_capturing():
                raise ValueError("kv_scale is a GPU tensor, which cannot be read while a CUDA graph is captured "
                                 "(the scale is fixed at capture): pass it as a Python float")
            kv_scale = kv_scale.item()  # (a GPU tensor: a host sync on every call; pass a float to avoid it)
        s = float(kv_scale)
        if not (0.0 < s < float("inf")):
            raise ValueError(f"kv_scale must be a positive finite number, got {s}")
        return s
    if kv_scale is not None:
        raise ValueError(f"kv_scale applies to an fp8 cache; kv is {getattr(kv, 'dtype', type(kv).__name__)}")
    return 1.0


def mla_combine(o_part, lse_part):
    """Merge split-KV partials by their LSE.

    o_part: [bs, num_splits, s_q, h_q, dv] fp32, dv 64, 128, 256 or 512
    (each split's normalised output; contiguous, starting on a 16-byte
    boundary); lse_part: [bs, num_splits, s_q, h_q] fp32 (natural log; -inf
    for an empty split, whose partial is never used). Returns (out [bs, s_q,
    h_q, dv] bf16, lse [bs, h_q, s_q] fp32)."""
    require_kernels(o_part.device)
    return torch.ops.mla_decode.combine(o_part, lse_part)


def attention_reference(q, kv, seqlens, softmax_scale, *, block_table=None, rope_cs=None, causal=False,
                        dtype=torch.float64, head_dim_v=DV, kpe_heads=None):
    """The op's semantics in plain PyTorch (``dtype`` math, one sequence at a
    time): the oracle of the attention tests."""
    bs, s_q, h_q, _ = q.shape
    dv = head_dim_v
    lens = seqlens.tolist()
    out = torch.zeros(bs, s_q, h_q, dv, dtype=dtype, device=q.device)
    lse = torch.full((bs, h_q, s_q), float("-inf"), dtype=dtype, device=q.device)
    for b in range(bs):
        L = lens[b]
        if L <= 0:
            continue
        rows_bf = kv_rows_bf16(kv, block_table, b, L).reshape(L, -1)
        rows = rows_bf.to(dtype)
        if rope_cs is not None:
            from .reference import rope_rotate

            half = rope_cs.shape[1] // 2
            cos = torch.cat([rope_cs[:L, :half]] * 2, dim=-1)
            sin = torch.cat([rope_cs[:L, half:]] * 2, dim=-1)
            k_pe = rope_rotate(rows_bf[:, dv:], cos, sin)
            rows = torch.cat([rows[:, :dv], k_pe.to(dtype)], dim=-1)
        if kpe_heads is None:
            s = torch.einsum("ihd,ld->ihl", q[b].to(dtype), rows)
        else:  # per-head rope keys: the latent part shared, the rope part per head
            kh = kv_rows_bf16(kpe_heads, block_table, b, L).to(dtype)  # [L, h_q, rope]
            s = (torch.einsum("ihd,ld->ihl", q[b, ..., :dv].to(dtype), rows)
                 + torch.einsum("ihr,lhr->ihl", q[b, ..., dv:].to(dtype), kh))
        s = s * softmax_scale
        if causal and s_q > 1:
            pos = torch.arange(L, device=q.device)
            lim = L - (s_q - 1 - torch.arange(s_q, device=q.device))
            s = s.masked_fill(pos[None, None, :] >= lim[:, None, None], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("ihl,ld->ihd", p, rows[:, :dv]) / torch.where(denom > 0, denom, torch.ones_like(denom))
        out[b] = o
        lse[b] = torch.where(denom[..., 0] > 0, (m + torch.log(denom))[..., 0], torch.full_like(m[..., 0], float("-inf"))).T
    return out, lse


def check_paged_rows(block_table, seqlens, num_blocks, page, names=("block_table", "seqlens", "kv")):
    """ValueError naming the first length outside [0, max_blocks * page],
    or the first used block-table slot whose id is outside [0, num_blocks).
    Reads the lengths and ids on the host (a synchronisation: for the
    PyTorch paths and debugging modes; the kernels read such an id as block
    0 and hold a length to the table's rows). ``names``: the caller's names
    of the block table, the lengths and the cache, for the message."""
    table_name, lens_name, cache_name = names
    lens = seqlens.to(torch.int64)
    cap = block_table.shape[1] * page
    bad_len = (lens < 0) | (lens > cap)
    if bool(bad_len.any()):
        i = int(bad_len.nonzero()[0, 0])
        raise ValueError(f"{lens_name}[{i}] = {int(lens[i])} is outside [0, {cap}] ({table_name}'s "
                         f"{block_table.shape[1]} slots of {page} rows)")
    used = (lens.to(block_table.device) + page - 1) // page                         # [b] slots in use
    slots = torch.arange(block_table.shape[1], device=block_table.device)
    bad = (slots[None, :] < used[:, None]) & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{table_name}[{b}, {i}] = {int(block_table[b, i])} is outside {cache_name}'s "
                         f"{num_blocks} blocks (sequence {b} uses its first {int(used[b])} slots)")


def kv_rows_bf16(kv, block_table, b, L):
    """Rows 0..L-1 of sequence b: kv[b, :L], or gathered from the pages of
    block_table (any trailing dimensions kept)."""
    if block_table is None:
        return kv[b, :L]
    page = kv.shape[1]
    pages = block_table[b, : (L + page - 1) // page].long()
    return kv[pages].reshape(-1, *kv.shape[2:])[:L]


if kernels_built():
    @torch.library.register_fake("mla_decode::plan")
    def _plan_fake(seqlens, s_q, h_q, capacity, split=True):
        # int32 [plan_size(bs, max_parts)] (csrc/kernels/attention/plan.h): max_parts = the planner's
        # target parts (from the GPU's SM count and the kernel's blocks per SM) + bs, or bs unsplit. On a
        # GPU the size is known while tracing, so torch.compile(fullgraph=True) needs no dynamic output
        # shapes. Elsewhere (CPU tensors, which the op refuses at run time) it is left data-dependent,
        # bounded below by the header's 2 ints and 2 per sequence (what get_mla_metadata slices).
        bs = seqlens.shape[0]
        if seqlens.device.type == "cuda" and isinstance(s_q, int) and isinstance(h_q, int):
            return seqlens.new_empty(plan_elems(bs, s_q, h_q, split, seqlens.device), dtype=torch.int32)
        n = torch.library.get_ctx().new_dynamic_size()
        torch._check(n >= 2 + 2 * bs)
        return seqlens.new_empty(n, dtype=torch.int32)

    @torch.library.register_fake("mla_decode::attention")
    def _attention_fake(q, kv, seqlens, block_table, rope_cs, softmax_scale, causal, kpe=None, head_dim_v=DV,
                        kpe_heads=None, plan=None, split=True, kv_scale=1.0):
        bs, s_q, h_q, _ = q.shape
        return q.new_empty(bs, s_q, h_q, head_dim_v), q.new_empty(bs, h_q, s_q, dtype=torch.float32)

    @torch.library.register_fake("mla_decode::combine")
    def _combine_fake(o_part, lse_part):
        bs, _, s_q, h_q, dv = o_part.shape
        return (o_part.new_empty(bs, s_q, h_q, dv, dtype=torch.bfloat16),
                o_part.new_empty(bs, h_q, s_q))

    @torch.library.register_fake("mla_decode::merge_states")
    def _merge_states_fake(outs, lses):
        _, bs, s_q, h_q, dv = outs.shape
        return outs.new_empty(bs, s_q, h_q, dv), lses.new_empty(bs, h_q, s_q)
