"""Decode context parallelism (DCP) for the serving API: every sequence's
latent cache split across the N ranks of a process group, each rank attends
over its own keys, and the partial results are merged by their LSE.

MLA has one latent KV head, so head-sharded tensor parallelism (tp.py) keeps
the whole cache on every rank; DCP keeps 1/N of every sequence's tokens per
rank instead (issue 34). The pieces:

- ``merge_attention_states(outs, lses)``: merge N partial (out, lse) pairs of
  the same queries over disjoint key sets (plain PyTorch, fp32 math).
- ``dcp_local_lengths`` / ``dcp_global_positions`` / ``dcp_shard_cache``:
  which tokens a rank holds under the two layouts, and a rank's paged cache
  built from a full one (for tests and for migrating a cache).
- ``dcp_attention(q, k_cache_local, block_table_local, seqlens_local, dv,
  scale, group=...)``: local attention, one all-gather of (out, lse) over the
  group (torch.distributed: NCCL/RCCL on GPUs, gloo on the CPU), merge; every
  rank returns the full (out, lse).

Layouts (N = world, r = rank, L = a sequence's length, C = ``chunk``):

- ``"interleaved"`` (default; vLLM's layout): token t lives on rank
  (t // C) mod N, C defaulting to 1 (token t on rank t mod N; C plays the role
  of vLLM's interleave size). Rank r's local position j holds global token
  (j // C) * N * C + r * C + j % C. Appending a token never moves others.
- ``"contiguous"``: rank r holds tokens [r * C, min((r + 1) * C, L)). With
  ``chunk=None`` C = ceil(L / N) per sequence (the sequence cut into N
  consecutive chunks, the last ones shorter or empty): suited to a cache
  split once, since C and so every boundary moves as L grows. With
  ``chunk=C`` given the boundaries are fixed (rank 0 fills first, then rank
  1, ...), and a length above N * C raises ValueError.

The attention is a sum over keys, so the merged result does not depend on
which rank holds which token: dcp_attention takes no layout. It uses keys as
stored (no on-the-fly RoPE, no ``rope_cs``: a key's rotation would need its
global position) and supports s_q = 1, or s_q > 1 without causal masking
(causal masking compares positions, and a rank's local positions are not
global positions).

Tested on the CPU (gloo, 2 and 3 processes, the PyTorch backend) and on 2
and 4 GPUs (NCCL, the kernels): tests/test_dcp.py. See docs/multi_gpu.md.
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.distributed as dist

from . import _ext
from ._ext import kernels_usable, require_kernels

__all__ = ["merge_attention_states", "dcp_local_lengths", "dcp_global_positions", "dcp_shard_cache",
           "dcp_attention", "DCP_LAYOUTS"]

DCP_LAYOUTS = ("interleaved", "contiguous")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------- merge

def merge_attention_states(outs, lses):
    """Merge N partial attention results of the same queries over disjoint
    key sets.

    outs: [N, b, s_q, h_q, dv] (any float dtype; or a list/tuple of N tensors
    [b, s_q, h_q, dv]), each partial normalised over its own keys; lses:
    [N, b, h_q, s_q] fp32 (or a list of N [b, h_q, s_q]), natural log, -inf
    for a partial that saw no key. Returns (out [b, s_q, h_q, dv] in outs'
    dtype, lse [b, h_q, s_q] fp32):

        lse = logsumexp_r lse_r,   out = sum_r exp(lse_r - lse) * out_r

    computed in fp32 (float64 when outs are float64). Where every lse_r is
    -inf the result is out 0 and lse -inf, never NaN; a partial whose lse is
    -inf contributes nothing, whatever its out holds.

    On a GPU the compiled kernels run on, with bf16, fp16 or fp32 outs, one
    kernel reads each partial once (exp2/log2 in hardware approximation, as
    the attention's own combine); elsewhere (the CPU, float64) plain PyTorch
    in the same fp32 (float64) arithmetic."""
    outs = _stack(outs, "outs")
    lses = _stack(lses, "lses")
    if outs.dtype not in _FLOATS:
        raise TypeError(f"outs must be a float tensor (float16, bfloat16, float32, float64), got {outs.dtype}")
    if lses.dtype != torch.float32:
        raise TypeError(f"lses must be float32 (natural log), got {lses.dtype}")
    if outs.device != lses.device:
        raise ValueError(f"outs and lses must be on one device, got {outs.device} and {lses.device}")
    if outs.dim() != 5:
        raise ValueError(f"outs must have shape [N, b, s_q, h_q, dv], got {list(outs.shape)}")
    n, b, s_q, h_q, _ = outs.shape
    if tuple(lses.shape) != (n, b, h_q, s_q):
        raise ValueError(f"lses must have shape [N, b, h_q, s_q] = {[n, b, h_q, s_q]} to match outs "
                         f"{list(outs.shape)}, got {list(lses.shape)}")
    if n == 0:
        raise ValueError("nothing to merge: N = 0 partials")
    if outs.dtype != torch.float64 and kernels_usable(outs.device):
        return torch.ops.mla_decode.merge_states(outs.contiguous(), lses.contiguous())
    acc = torch.float64 if outs.dtype == torch.float64 else torch.float32
    scale, lse = _merge_weights(lses, acc)
    scale = scale.transpose(-1, -2).unsqueeze(-1)                    # [N, b, s_q, h_q, 1]
    contrib = torch.where(scale > 0, scale * outs.to(acc), torch.zeros((), dtype=acc, device=outs.device))
    return contrib.sum(dim=0).to(outs.dtype), lse.to(torch.float32)


def _merge_weights(lses, acc):
    """The merge's weights exp(lse_r - lse) [N, b, h_q, s_q] (0 for a partial
    with lse -inf) and lse = logsumexp_r lse_r [b, h_q, s_q] (-inf where every
    partial is), in dtype ``acc``. Three elementwise passes and a reduction:
    on a GPU these tiny tensors cost the host's launches, not the device."""
    lse_r = lses.to(acc)
    lse = torch.logsumexp(lse_r, dim=0)                              # -inf where every partial is
    # exp(-inf - lse) = 0 for a -inf partial; where every partial is -inf, exp(nan) -> 0
    return torch.exp(lse_r - lse).nan_to_num_(nan=0.0), lse


def _stack(x, name):
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{name}: nothing to merge (an empty list)")
        if not all(isinstance(t, torch.Tensor) for t in x):
            raise TypeError(f"{name} must be a tensor or a list of tensors")
        first = x[0]
        for i, t in enumerate(x):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"{name}[{i}] is {t.dtype} {list(t.shape)} on {t.device}, {name}[0] is "
                                 f"{first.dtype} {list(first.shape)} on {first.device}: they must agree")
        return torch.stack(list(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or a list of tensors, got {type(x).__name__}")
    return x


# ---------------------------------------------------------------------------- layouts

def _check_layout(rank, world, layout, chunk):
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank!r}")
    if layout not in DCP_LAYOUTS:
        raise ValueError(f"layout must be one of {DCP_LAYOUTS}, got {layout!r}")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be None or a positive int, got {chunk!r}")


def dcp_local_lengths(seqlens, rank: int, world: int, layout: str = "interleaved", chunk=None):
    """How many tokens of each sequence rank ``rank`` of ``world`` holds.

    seqlens: [b] integer tensor (any device; or a list of ints) of full
    lengths. Returns [b] int32 on seqlens' device (no host synchronisation).
    interleaved (C = chunk or 1): L // (N C) * C + clamp(L % (N C) - r C, 0, C);
    contiguous (C = chunk or ceil(L / N)): clamp(L - r C, 0, C), and with
    ``chunk`` given a length above N * C raises ValueError (a check that
    reads the lengths on the host). The counts of the N ranks sum to L."""
    _check_layout(rank, world, layout, chunk)
    if not isinstance(seqlens, torch.Tensor):
        seqlens = torch.tensor(list(seqlens), dtype=torch.int64)
    if seqlens.dim() != 1 or seqlens.dtype.is_floating_point or seqlens.dtype.is_complex or seqlens.dtype == torch.bool:
        raise TypeError(f"seqlens must be a 1-D integer tensor [b], got {seqlens.dtype} {list(seqlens.shape)}")
    L = seqlens.to(torch.int64)
    if layout == "interleaved":
        c = chunk or 1
        period = world * c
        local = L // period * c + (L % period - rank * c).clamp(0, c)
    else:
        if chunk is None:
            c = (L + world - 1) // world
        else:
            c = torch.full_like(L, chunk)
            if bool((L > world * chunk).any()):
                raise ValueError(f"contiguous layout with chunk={chunk} holds at most world * chunk = "
                                 f"{world * chunk} tokens per sequence, got a length of {int(L.max())}")
        local = (L - rank * c).clamp(min=0)
        local = torch.minimum(local, c)
    return local.to(torch.int32)


def dcp_global_positions(length: int, rank: int, world: int, layout: str = "interleaved", chunk=None):
    """The global token positions rank ``rank`` holds of a sequence of
    ``length`` tokens, in local order: an int64 tensor on the CPU whose
    entry j is the position of the rank's local token j (see the module
    docstring for the rules)."""
    _check_layout(rank, world, layout, chunk)
    length = int(length)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    n = int(dcp_local_lengths(torch.tensor([length]), rank, world, layout, chunk)[0])
    j = torch.arange(n, dtype=torch.int64)
    if layout == "interleaved":
        c = chunk or 1
        return j // c * world * c + rank * c + j % c
    c = chunk if chunk is not None else (length + world - 1) // world
    return rank * c + j


def dcp_shard_cache(k_cache, block_table, seqlens, rank: int, world: int, layout: str = "interleaved", chunk=None,
                    page_block_size=None):
    """Rank ``rank``'s share of a full paged cache, as a new compact paged cache.

    k_cache: [num_blocks, page, (1,) d] (FlashMLA's layout, or without the
    head dimension); block_table: [b, max_blocks] int32; seqlens: [b] int
    (full lengths). Returns (k_cache_local, block_table_local,
    seqlens_local): k_cache_local [num_local_blocks, page_block_size, (1,)
    d] (same dtype, device and trailing dimensions as k_cache; page size
    defaults to k_cache's), holding rank's tokens of each sequence in local
    order (``dcp_global_positions``), sequence after sequence in fresh
    blocks 0, 1, 2, ...; block_table_local [b, max(1, most local blocks)]
    int32 (unused slots 0); seqlens_local [b] int32 on seqlens' device. Rows
    past a sequence's local length are zero; at least one block is made, so
    the cache is never empty. Copies (a Python loop over the sequences): for
    tests and for migrating a cache once, not for a decode step."""
    _check_layout(rank, world, layout, chunk)
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() not in (3, 4):
        raise ValueError("k_cache must be [num_blocks, page_block_size, (1,) d], got "
                         f"{list(getattr(k_cache, 'shape', []))}")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise TypeError("block_table must be an int32 tensor [b, max_blocks], got "
                        f"{getattr(block_table, 'dtype', type(block_table))} {list(getattr(block_table, 'shape', []))}")
    page = k_cache.shape[1]
    lp = page if page_block_size is None else int(page_block_size)
    if lp < 1:
        raise ValueError(f"page_block_size must be >= 1, got {page_block_size}")
    if not isinstance(seqlens, torch.Tensor):
        seqlens = torch.tensor(list(seqlens), dtype=torch.int32)
    if seqlens.dim() != 1 or seqlens.shape[0] != block_table.shape[0]:
        raise ValueError(f"seqlens must be [b] with b = {block_table.shape[0]} (block_table's rows), "
                         f"got {list(seqlens.shape)}")
    lens = [int(v) for v in seqlens.tolist()]
    if any(L < 0 for L in lens):
        raise ValueError(f"seqlens must be >= 0, got {lens}")
    for i, L in enumerate(lens):
        if L > block_table.shape[1] * page:
            raise ValueError(f"sequence {i} has length {L} but its block table row holds "
                             f"{block_table.shape[1]} blocks of {page} = {block_table.shape[1] * page} tokens")
    local_lens = dcp_local_lengths(seqlens.cpu(), rank, world, layout, chunk).tolist()
    nblocks = [(n + lp - 1) // lp for n in local_lens]
    total = max(1, sum(nblocks))
    trail = k_cache.shape[2:]
    out = torch.zeros((total, lp) + tuple(trail), dtype=k_cache.dtype, device=k_cache.device)
    table = torch.zeros((len(lens), max([1] + nblocks)), dtype=torch.int32, device=block_table.device)
    flat_out = out.view(total * lp, *trail)
    flat_in = k_cache.reshape(k_cache.shape[0] * page, *trail)
    nxt = 0
    for i, L in enumerate(lens):
        n = local_lens[i]
        if n == 0:
            continue
        pos = dcp_global_positions(L, rank, world, layout, chunk).to(block_table.device)
        ids = block_table[i, pos // page].to(torch.int64)
        if bool(((ids < 0) | (ids >= k_cache.shape[0])).any()):
            raise ValueError(f"block_table row {i} names a block outside k_cache's {k_cache.shape[0]} blocks")
        rows = flat_in[(ids * page + pos % page).to(k_cache.device)]
        flat_out[nxt * lp: nxt * lp + n] = rows
        table[i, :nblocks[i]] = torch.arange(nxt, nxt + nblocks[i], dtype=torch.int32, device=table.device)
        nxt += nblocks[i]
    return out, table, torch.tensor(local_lens, dtype=torch.int32, device=seqlens.device)


# ---------------------------------------------------------------------------- attention

def dcp_attention(q, k_cache_local, block_table_local, seqlens_local, head_dim_v, softmax_scale=None, *,
                  causal=False, group=None, backend="auto", scatter_heads=False):
    """Attention over a cache split across the ranks of ``group`` (default:
    the world), merged by LSE; the full result on every rank, or with
    ``scatter_heads=True`` the rank's share of the heads.

    q: [b, s_q, h_q, d], the SAME queries on every rank (every rank computes
    or receives all heads of all sequences; no all-gather of q is done here:
    a caller whose ranks hold different heads gathers q first, as vLLM does);
    k_cache_local: this rank's pages [num_blocks, page, (1,) d];
    block_table_local: [b, max_blocks] int32; seqlens_local: [b] int32, this
    rank's number of tokens per sequence (``dcp_local_lengths``; 0 allowed);
    head_dim_v: dv; softmax_scale: defaults to d ** -0.5. Keys are used as
    stored (no RoPE applied here). s_q = 1, or s_q > 1 with causal=False;
    causal=True with s_q > 1 raises ValueError.

    backend: "kernels" (mla_attention with the block table: q and the cache
    bf16 or fp16 on a GPU the kernels run on, seqlens on it), "torch"
    (attention_reference in fp32 on any device: the CPU path), or "auto"
    (kernels where usable on q's device, else torch). Then the all-gather of
    the ranks' (out, lse) over the group (torch.distributed: NCCL/RCCL into
    one tensor each for GPU tensors, gloo for CPU ones packed into one
    buffer) and ``merge_attention_states`` (one kernel on a GPU). The
    kernels' partial out is rounded to q's dtype before the merge (as the
    partials of vLLM's DCP are); the torch backend's partials stay fp32
    until the merged result is cast.

    scatter_heads=True (h_q a multiple of the group's size N): rank r
    receives only heads [r h_q / N, (r + 1) h_q / N) of the merged result,
    as a head-sharded output projection wants them (vLLM's DCP
    reduce-scatters so): the ranks' LSEs are all-gathered (b x h_q x s_q
    fp32 each), every rank scales its partial by its weight exp(lse_r - lse)
    in fp32 (one pass, into head-major order), and one reduce-scatter over
    the heads sums them (fp32, so the sum is not rounded to q's dtype on the
    way; NCCL's reduce_scatter on GPUs, an all-reduce and a slice on gloo).
    A rank then receives (N - 1) / N of its share's fp32 partial sums
    instead of N - 1 whole partials in q's dtype: at N = 4, half the bytes
    of the all-gather (docs/multi_gpu.md has the measurements).

    Returns (out [b, s_q, h_q, dv] in q's dtype, lse [b, h_q, s_q] fp32),
    equal on every rank (with scatter_heads: out [b, s_q, h_q / N, dv], lse
    [b, h_q / N, s_q], the rank's heads); a sequence with no token on any
    rank gives out 0, lse -inf. Every rank of the group must call it with
    the same b, s_q, h_q, dv, dtype and scatter_heads (a collective)."""
    if backend not in ("auto", "kernels", "torch"):
        raise ValueError(f"backend must be 'auto', 'kernels' or 'torch', got {backend!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must have shape [b, s_q, h_q, d], got {list(getattr(q, 'shape', []))}")
    b, s_q, h_q, d = q.shape
    if q.dtype not in _FLOATS:
        raise TypeError(f"q must be a float tensor, got {q.dtype}")
    if causal and s_q > 1:
        raise ValueError(
            "dcp_attention: causal=True with s_q > 1 is not supported: causal masking compares each key's "
            "position with the query's, and a rank's local positions are not global positions (under the "
            "interleaved layout local token j is global token j * N + r), so the local attention would mask "
            "the wrong keys. Use s_q = 1, or s_q > 1 with causal=False.")
    if not isinstance(k_cache_local, torch.Tensor) or k_cache_local.dim() not in (3, 4) or (
            k_cache_local.dim() == 4 and k_cache_local.shape[2] != 1):
        raise ValueError("k_cache_local must be [num_blocks, page_block_size, (1,) d] with one KV head, got "
                         f"{list(getattr(k_cache_local, 'shape', []))}")
    if k_cache_local.shape[-1] != d:
        raise ValueError(f"k_cache_local's last dimension must be q's d = {d}, got {k_cache_local.shape[-1]}")
    if not 0 < int(head_dim_v) <= d:
        raise ValueError(f"head_dim_v must be in (0, {d}], got {head_dim_v}")
    if block_table_local is None:
        raise ValueError("block_table_local is required ([b, max_blocks] int32)")
    if (not isinstance(block_table_local, torch.Tensor) or block_table_local.dtype != torch.int32
            or block_table_local.dim() != 2 or block_table_local.shape[0] != b):
        raise TypeError(f"block_table_local must be an int32 tensor [b = {b}, max_blocks], got "
                        f"{getattr(block_table_local, 'dtype', type(block_table_local))} "
                        f"{list(getattr(block_table_local, 'shape', []))}")
    if (not isinstance(seqlens_local, torch.Tensor) or seqlens_local.dtype != torch.int32
            or tuple(seqlens_local.shape) != (b,)):
        raise TypeError(f"seqlens_local must be an int32 tensor [b = {b}], got "
                        f"{getattr(seqlens_local, 'dtype', type(seqlens_local))} "
                        f"{list(getattr(seqlens_local, 'shape', []))}")
    for name, t in (("k_cache_local", k_cache_local), ("block_table_local", block_table_local),
                    ("seqlens_local", seqlens_local)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if backend == "auto":
        which = "kernels" if kernels_usable(q.device) else "torch"
        if which == "torch":
            warn_fallback("dcp_attention", q.device, _ext.backend(q.device))
    else:
        which = backend
    if which == "kernels":
        require_kernels(q.device)
    else:
        from .attention import check_paged_rows

        check_paged_rows(block_table_local, seqlens_local, k_cache_local.shape[0], k_cache_local.shape[1],
                         ("block_table_local", "seqlens_local", "k_cache_local"))
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dcp_attention needs an initialised torch.distributed process group "
                           "(dist.init_process_group(\"nccl\") on GPUs, \"gloo\" on the CPU; a world of 1 works)")

    world = dist.get_world_size(group)
    if scatter_heads and h_q % world != 0:
        raise ValueError(f"scatter_heads=True needs h_q a multiple of the group's size {world}, got h_q {h_q}")
    dv = int(head_dim_v)
    if which == "kernels":
        from .attention import mla_attention

        out, lse = mla_attention(q, k_cache_local, seqlens_local, float(softmax_scale), block_table=block_table_local,
                                 head_dim_v=dv)
    else:
        from .attention import attention_reference

        pages = k_cache_local if k_cache_local.dim() == 3 else k_cache_local[:, :, 0]
        out, lse = attention_reference(q, pages, seqlens_local, float(softmax_scale), block_table=block_table_local,
                                       dtype=torch.float32, head_dim_v=dv)
    out, lse = out.contiguous(), lse.to(torch.float32).contiguous()

    if world == 1:
        return out.to(q.dtype), lse
    if scatter_heads:
        return _merge_scatter_heads(out, lse, world, dist.get_rank(group), group, q.dtype,
                                    finite=which == "kernels")
    outs, lses = _all_gather_pair(out, lse, world, group)
    merged, mlse = merge_attention_states(outs, lses)
    return merged.to(q.dtype), mlse


_warned = set()
_warned_lock = threading.Lock()


def warn_fallback(what, device, why):
    """A RuntimeWarning, once per (what, device, why), that a GPU call of
    ``what`` runs the PyTorch backend (backend="auto" where the kernels are
    not usable): a slow path, said once rather than hidden."""
    if device.type != "cuda":
        return
    key = (what, str(device), why)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"mla_decode: {what} runs the PyTorch backend on {device}: {why}", RuntimeWarning, stacklevel=3)


def _merge_scatter_heads(out, lse, world, rank, group, dtype, finite=False):
    """The merge of the ranks' (out [b, s_q, h_q, dv], lse [b, h_q, s_q]) by
    their LSE, rank `rank` receiving heads [rank hs, (rank + 1) hs), hs =
    h_q / world: all-gathered LSEs, each partial scaled by its weight in
    fp32 into head-major order in one pass, one fp32 reduce-scatter (sum)
    over the heads. finite: `out` is known finite (the kernels' partials:
    an empty part's out is 0), so no guard against a -inf partial's out."""
    b, s_q, h_q, dv = out.shape
    hs = h_q // world
    lses = _all_gather_lse(lse, world, group)
    heads, mlse = _scaled_heads(out, lses, rank, torch.float32, finite)
    mine = _reduce_scatter_heads(heads, world, rank, group)
    res = torch.empty((b, s_q, hs, dv), dtype=dtype, device=out.device)
    res.copy_(mine.permute(1, 2, 0, 3))
    return res, mlse[:, rank * hs:(rank + 1) * hs].contiguous()


def _all_gather_lse(lse, world, group):
    """The ranks' lse [b, h_q, s_q] fp32 as one tensor [world, b, h_q, s_q]."""
    lses = torch.empty((world, *lse.shape), dtype=lse.dtype, device=lse.device)
    if lse.is_cuda:
        dist.all_gather_into_tensor(lses, lse.contiguous(), group=group)
    else:
        dist.all_gather(list(lses.unbind(0)), lse.contiguous(), group=group)
    return lses


def _scaled_heads(out, lses, rank, dtype, finite):
    """Rank `rank`'s partial out [b, s_q, h_q, dv] scaled by its merge weight
    exp(lse_rank - lse) (fp32), written head-major [h_q, b, s_q, dv] in
    `dtype` by one elementwise pass; and the merged lse [b, h_q, s_q]. A
    partial with lse -inf weighs 0 (with finite=False its out is not read
    into the result even if it holds NaN)."""
    b, s_q, h_q, dv = out.shape
    w, mlse = _merge_weights(lses, torch.float32)
    w = w[rank].permute(1, 0, 2).unsqueeze(-1)                        # [h_q, b, s_q, 1]
    src = out.permute(2, 0, 1, 3)                                     # [h_q, b, s_q, dv], a view
    heads = torch.empty((h_q, b, s_q, dv), dtype=dtype, device=out.device)
    if finite:
        torch.mul(src, w, out=heads)
    else:
        heads.copy_(torch.where(w > 0, src.float() * w, torch.zeros((), device=out.device)))
    return heads, mlse


def _reduce_scatter_heads(heads, world, rank, group):
    """Sum over the ranks of heads [h_q, ...], rank `rank` receiving its
    h_q / world heads: NCCL's reduce-scatter on GPUs, an all-reduce and a
    slice on gloo (which has no reduce-scatter)."""
    hs = heads.shape[0] // world
    if heads.is_cuda:
        mine = torch.empty((hs, *heads.shape[1:]), dtype=heads.dtype, device=heads.device)
        dist.reduce_scatter_tensor(mine, heads, group=group)
        return mine
    dist.all_reduce(heads, group=group)
    return heads[rank * hs:(rank + 1) * hs]


def _all_gather_pair(out, lse, world, group):
    """The ranks' (out, lse): ([world, *out.shape] in out's dtype, [world,
    *lse.shape] fp32). On GPUs two all-gathers into one tensor each (no
    copies after); on the CPU one all-gather of both packed as bytes into one
    buffer (gloo gathers into a list)."""
    if out.is_cuda:
        outs = torch.empty((world, *out.shape), dtype=out.dtype, device=out.device)
        dist.all_gather_into_tensor(outs, out, group=group)
        return outs, _all_gather_lse(lse, world, group)
    ob = out.view(-1).view(torch.uint8)
    lb = lse.view(-1).view(torch.uint8)
    buf = torch.cat([ob, lb])
    got = torch.empty(world * buf.numel(), dtype=torch.uint8, device=buf.device)
    dist.all_gather(list(got.view(world, -1).unbind(0)), buf, group=group)
    got = got.view(world, -1)
    outs = got[:, :ob.numel()].contiguous().view(out.dtype).view(world, *out.shape)
    lses = got[:, ob.numel():].contiguous().view(torch.float32).view(world, *lse.shape)
    return outs, lses
