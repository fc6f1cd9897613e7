"""Decode context parallelism (DCP) for custom_kernel's layer: every
sequence's latent cache split over the N ranks of a process group, the
weights replicated.

Rank r holds the cache rows of tokens t with t mod N == r (the interleaved
layout of mla_decode.dcp, vLLM's), in local order: local row j is token
j N + r. A step, on every rank with the same x:

1. the projections (down, query), as on one GPU;
2. the new row x W_kvd^T written by its owner rank, (L - 1) mod N, at local
   row (L - 1) // N (L the length after the step);
3. the rank's attention over its rows, with the keys' RoPE applied on the
   fly at their GLOBAL positions (a RoPE table of rows r, r + N, ...) and
   q_pe rotated at the new token's global position;
4. the ranks' (out, lse) all-gathered and merged by LSE
   (mla_decode.dcp: one all-gather each for out and lse, the merge kernel);
5. W_UV and wo, as on one GPU: every rank returns the full y.

(Scattering the heads instead, as vLLM does: the LSEs all-gathered, each
partial scaled by its merge weight, one fp32 reduce-scatter into rank r's
H / N heads, W_UV and wo on those heads, one fp32 all-reduce of y, was
measured slower than the all-gather, the host's small PyTorch ops around
its three collectives being the cost: docs/not_kept.md.)

    import torch.distributed as dist
    from mla_decode.dcp_step import DCPDecoder, dcp_shard_task_cache

    dist.init_process_group("nccl")          # RCCL on ROCm builds; "gloo" on the CPU
    r, n = dist.get_rank(), dist.get_world_size()
    kv_local = dcp_shard_task_cache(kv_cache, r, n)   # once: rank r's rows (or build only those)
    dec = DCPDecoder()
    y, data = dec(config, x, kv_local)       # kv_local.seq_len is the GLOBAL length; advanced by one

The cache per rank is 1/N of the rows; the weights and the projections'
work are not divided (each rank streams all 374 MB at the task's shape).
Verified on the CPU (gloo, 2 and 3 processes, the PyTorch backend; and the
kernels branch in 2 and 4 processes with the attention op replaced by its
PyTorch oracle) against the float64 step on the whole cache; with the
kernels on 2 and 4 GPUs within the task's rule of the reference
(tests/test_dcp_step.py). Measurements: docs/multi_gpu.md.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from . import kernel_choice
from . import projections
from ._ext import kernels_usable
from .attention import mla_attention
from .dcp import _all_gather_pair, merge_attention_states, warn_fallback
from .decoder import MLADecoder, rope_tables
from .reference import rope_rotate
from .validate import MLAInputError, cache_parts, validate

__all__ = ["DCPDecoder", "DCPCache", "dcp_shard_task_cache"]


class DCPCache:
    """A rank's share of the task's KVCache: ``data`` [bs, local capacity,
    kv_lora_rank + rope] bf16 (local row j = token j N + rank), ``seq_len``
    the sequences' GLOBAL length (the same on every rank)."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        self.data = data
        self.seq_len = seq_len


def dcp_shard_task_cache(kv_cache, rank: int, world: int) -> DCPCache:
    """Rank's rows of the task's KVCache (``.data`` [bs, max_seq_len, d],
    ``.seq_len``) in the interleaved layout: a new DCPCache whose data holds
    rows rank, rank + world, ... of kv_cache.data (capacity ceil(max_seq_len
    / world); rows past the cache zero) and the same seq_len. A copy, made
    once; a step never moves rows between ranks."""
    data, seq_len = cache_parts(kv_cache)
    if not isinstance(data, torch.Tensor) or data.dim() != 3:
        raise MLAInputError(f"kv_cache.data must be a [bs, max_seq_len, d] tensor, got {getattr(data, 'shape', data)}")
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"need 0 <= rank < world, got rank {rank!r}, world {world!r}")
    bs, cap, d = data.shape
    local = torch.zeros(bs, (cap + world - 1) // world, d, dtype=data.dtype, device=data.device)
    mine = data[:, rank::world]
    local[:, :mine.shape[1]] = mine
    return DCPCache(local, seq_len)


class DCPDecoder:
    """The layer's decode step with the cache split over the ranks of
    ``group`` (default: the world); see the module's text.

    ``dec(config, x, kv_local)`` -> (y [bs, 1, dim] bf16, kv_local.data):
    every rank of the group calls it with the same config (the full
    weights), the same x and its own DCPCache (or any object with ``data``
    [bs, local capacity, kv_lora_rank + rope] and ``seq_len`` = the global
    length); the new row goes to its owner rank; ``seq_len`` advances by one
    on every rank; y is the same on every rank.

    backend: "kernels" (the GPU kernels: projections as on one GPU, the
    attention op with its on-the-fly key RoPE; kv_lora_rank 512 and rope 64),
    "torch" (PyTorch with the task reference's rounding, for the CPU), or
    "auto" (kernels where they run on x's device and the sizes are theirs).
    Inputs are checked as custom_kernel checks them (MLAInputError or
    TypeError, nothing written); a full local cache raises; backend="kernels"
    where the kernels do not run or take the sizes raises RuntimeError, as
    MLADecoder does (kernel_choice.step_backend decides for both). A group of one
    runs custom_kernel's own step (an MLADecoder with this backend, its
    graph replays included).

    Cost: as it stands the step is SLOWER than custom_kernel on one GPU at
    the task's shapes (prefill 6144: 1.3x one GPU's time on two H100s,
    1.9-2.2x on two and four H200s; docs/multi_gpu.md): every rank still
    streams all the weights, and about twenty small ops launched from
    Python surround the exchange. What it is for: a cache too long for one
    GPU's memory (each rank holds 1/N of the rows), not speed."""

    def __init__(self, group=None, backend: str = "auto"):
        if backend not in ("auto", "kernels", "torch"):
            raise ValueError(f"backend must be 'auto', 'kernels' or 'torch', got {backend!r}")
        self.group = group
        self.backend = backend
        self.last_backend = None
        self._tables = {}
        self._outgrown = []
        self._lock = threading.Lock()
        self._single = None  # a group of one: custom_kernel's own decoder

    def _rank_table(self, device, rope, world, rank, cap):
        """The RoPE rows of this rank's tokens: row j = global position j N + rank."""
        key = (device, rope, world, rank)
        t = self._tables.get(key)
        if t is None or t.shape[0] < cap:
            with self._lock:
                t = self._tables.get(key)
                if t is None or t.shape[0] < cap:
                    if t is not None:  # (kept: a graph captured with it reads it where it lies)
                        self._outgrown.append(t)
                    full = rope_tables(device, rope, world * cap).cs
                    t = self._tables[key] = full[rank::world][:cap].contiguous()
        return t

    def __call__(self, config, x, kv_local):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DCPDecoder needs an initialised torch.distributed process group "
                               "(dist.init_process_group(\"nccl\") on GPUs, \"gloo\" on the CPU; a world of 1 works)")
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        data, pos = cache_parts(kv_local)
        dims = validate(config, x, DCPCache(data, 0))  # everything but the capacity, which is global here
        if not isinstance(pos, int) or isinstance(pos, bool) or pos < 0:
            raise MLAInputError(f"kv_cache.seq_len must be a non-negative int, got {pos!r}")
        cap = data.shape[1]
        if pos // world >= cap:
            raise MLAInputError(f"kv_cache is full: global seq_len {pos} needs local row {pos // world} on rank "
                                f"{pos % world}, local capacity {cap} (world {world}); nothing was written")
        if world == 1:  # the one-GPU step itself (its replays included)
            if self._single is None:
                self._single = MLADecoder(backend=self.backend)
            y, _ = self._single(config, x, kv_local)
            self.last_backend = self._single.last_backend
            return y, data
        usable = self.backend != "torch" and kernels_usable(x.device)
        which, why = kernel_choice.step_backend(self.backend, dims, usable, x.device)
        if why is not None:
            warn_fallback("DCPDecoder", x.device, why)
        with torch.no_grad():
            y = self._step(config, dims, x, data, pos, world, rank, which)
        kv_local.seq_len = pos + 1
        self.last_backend = which
        return y, data

    def _step(self, config, dims, x, data, pos, world, rank, which):
        bs, H, r, nope, rope, v = dims.bs, dims.heads, dims.kv_lora, dims.nope, dims.rope, dims.v
        dev = x.device
        cap = data.shape[1]
        _, cos2, sin2 = rope_tables(dev, rope, world * cap)
        wkv = config.KV_proj_up_weight.view(H, nope + v, r)
        # 1. projections, as on one GPU
        q_lora, kv_new = projections.down(x.view(bs, dims.dim), config.Q_proj_down_weight,
                                          config.KV_proj_down_weight)
        qbuf = torch.empty(H, bs, r + rope, dtype=torch.bfloat16, device=dev)
        q_pe = projections.query(q_lora, config.Q_proj_up_weight, wkv[:, :nope, :], qbuf)
        # q_pe rotated at the new token's global position (the task's RoPE, as rope_append rounds it)
        projections._rope_out(qbuf, rope).copy_(rope_rotate(q_pe, cos2[pos], sin2[pos]))
        # 2. the new row, on its owner rank, at its local row
        if pos % world == rank:
            with projections.writable(data):
                data[:, pos // world] = kv_new
        # 3. this rank's attention over its rows, keys rotated at their global positions
        L = pos + 1
        local_len = L // world + (1 if rank < L % world else 0)
        seqlens = torch.full((bs,), local_len, dtype=torch.int32, device=dev)
        q = projections._attention_query(qbuf)
        scale = 1.0 / math.sqrt(nope + rope)
        rope_cs = self._rank_table(dev, rope, world, rank, cap)
        if which == "kernels":
            out, lse = mla_attention(q, data, seqlens, scale, rope_cs=rope_cs, head_dim_v=r)
        else:
            mine = slice(rank, world * local_len, world)  # the global positions of this rank's rows
            out, lse = _attention_torch(q[:, 0], data[:, :local_len], cos2[mine], sin2[mine], r, scale)
        lse = lse.to(torch.float32).contiguous()
        # 4. the ranks' partials merged by LSE (all gathered; see the module's text for the heads scattered;
        # a group of one never gets here)
        outs, lses = _all_gather_pair(out.contiguous(), lse, world, self.group)
        out, _ = merge_attention_states(outs, lses)
        # 5. W_UV, then wo, as on one GPU
        obuf = torch.empty(bs, H, v, dtype=torch.bfloat16, device=dev)
        y = torch.empty(bs, dims.dim, dtype=torch.bfloat16, device=dev)
        projections.output(out[:, 0].to(torch.bfloat16), wkv[:, nope:, :].transpose(1, 2), config.wo_weight, obuf, y)
        return y.view(bs, 1, dims.dim)


def _attention_torch(q, rows, cos, sin, r, scale):
    """A rank's absorbed attention in PyTorch with the task reference's
    rounding (bf16 products, fp32 scores, P rounded to bf16 before P c):
    q [bs, H, r + rope] (q_pe rotated), rows [bs, n, r + rope] un-rotated,
    cos/sin [n, rope] at the rows' global positions ([a, a] layout). Returns
    (out [bs, 1, H, r] fp32, lse [bs, H, 1] fp32, -inf where n is 0)."""
    c = rows[..., :r]
    k_pe = rope_rotate(rows[..., r:], cos, sin)
    scores = (torch.bmm(q[..., :r], c.transpose(1, 2)).float() +
              torch.bmm(q[..., r:], k_pe.transpose(1, 2)).float()) * scale       # [bs, H, n]
    lse = torch.logsumexp(scores, dim=-1)                                       # -inf for n = 0
    p = torch.exp(scores - lse.unsqueeze(-1)).to(torch.bfloat16)
    # P c accumulated in fp32 and kept so (rounded once, after the merge)
    return torch.bmm(p.float(), c.float()).unsqueeze(1), lse.unsqueeze(-1)
