"""The oracle: the task's decode step, written literally (docs/architecture.md, "What it computes").

Non-absorbed, every intermediate in bf16 exactly where the task has it:
projections are bf16 matrix products (fp32 accumulation, bf16 result), RoPE
is the task's rotate-half in bf16 with bf16 angles, keys are rotated at their
own position on every call, softmax runs in fp32 and is rounded to bf16.
Every correctness test compares against this module.

Also here: the task's input types (``Config``, ``KVCache``) and its input
generator, so tests and benchmarks build the same data the task does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "Config",
    "KVCache",
    "generate_input",
    "rope_theta",
    "rope_cos_sin",
    "rope_rotate",
    "ref_kernel",
    "decode_step",
]


@dataclass
class Config:
    batch_size: int
    dim: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    seq_len: int
    max_seq_len: int
    kv_cache_shape: tuple
    Q_proj_down_weight: torch.Tensor
    Q_proj_up_weight: torch.Tensor
    KV_proj_down_weight: torch.Tensor
    KV_proj_up_weight: torch.Tensor
    wo_weight: torch.Tensor


class KVCache:
    """The task's latent cache: ``data`` [bs, max_seq_len, kv_lora_rank + rope]
    bf16, ``seq_len`` rows filled. Rows hold [c | k_pe] with k_pe un-rotated."""

    def __init__(self, kv_cache_shape: tuple, device="cpu", dtype=torch.bfloat16):
        self.data = torch.zeros(kv_cache_shape, dtype=dtype, device=device)
        self.seq_len = 0

    def get_data(self) -> torch.Tensor:
        return self.data

    def prefill(self, rows: torch.Tensor) -> None:
        n = rows.shape[1]
        if self.seq_len + n > self.data.shape[1]:  # (an exception, not an assert: python -O keeps it)
            raise ValueError(f"KV Cache Exceeded: {self.seq_len} + {n} rows > max_seq_len {self.data.shape[1]}")
        self.data[:, self.seq_len:self.seq_len + n] = rows
        self.seq_len += n

    def clone(self) -> "KVCache":
        c = KVCache.__new__(KVCache)
        c.data = self.data.clone()
        c.seq_len = self.seq_len
        return c


def generate_input(batch_size=128, prefill=512, dim=7168, q_lora_rank=1536, n_heads=128,
                   kv_lora_rank=512, nope=128, rope=64, v=128, max_seq_len=8192,
                   seed=0, device="cpu", wo_scale="fan_in"):
    """Random inputs as the task draws them: weights ``randn / sqrt(fan_in)``,
    ``x ~ randn``, ``prefill`` cache rows ``randn``, the rest zero.
    ``wo_scale``: "fan_in" divides wo by sqrt(H*v) (the project's contract), "dim" by sqrt(dim)
    (the task page's generator)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, dtype=torch.bfloat16, generator=gen, device=device)

    wq_d = randn(q_lora_rank, dim) / math.sqrt(dim)
    wkv_d = randn(kv_lora_rank + rope, dim) / math.sqrt(dim)
    wq_u = randn(n_heads * (nope + rope), q_lora_rank) / math.sqrt(q_lora_rank)
    wkv_u = randn(n_heads * (nope + v), kv_lora_rank) / math.sqrt(kv_lora_rank)
    wo_div = math.sqrt(n_heads * v) if wo_scale == "fan_in" else math.sqrt(dim)
    wo = randn(dim, n_heads * v) / wo_div
    shape = (batch_size, max_seq_len, kv_lora_rank + rope)
    config = Config(
        batch_size=batch_size, dim=dim, n_heads=n_heads, q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=v, seq_len=1, max_seq_len=max_seq_len, kv_cache_shape=shape,
        Q_proj_down_weight=wq_d, Q_proj_up_weight=wq_u, KV_proj_down_weight=wkv_d,
        KV_proj_up_weight=wkv_u, wo_weight=wo,
    )
    x = randn(batch_size, 1, dim)
    kv_cache = KVCache(shape, device=device)
    if prefill:
        kv_cache.prefill(randn(batch_size, prefill, kv_lora_rank + rope))
    return config, x, kv_cache


# ----------------------------------------------------------------------- RoPE

def rope_theta(rope: int, device) -> torch.Tensor:
    """theta_j = 10000 ** (-j / (rope/2)), computed in bf16 as the task does."""
    return 10000 ** (-torch.arange(0, rope // 2, dtype=torch.bfloat16, device=device) / (rope // 2))


def rope_cos_sin(positions: torch.Tensor, rope: int):
    """(cos, sin), each [n, rope] bf16 laid out [a, a], for integer positions.
    The angle is the task's bf16 product (the position itself is rounded to
    bf16 by the promotion, as in the task's einsum)."""
    theta = rope_theta(rope, positions.device)
    angle = torch.einsum("s,d->sd", positions, theta)
    angle2 = torch.cat([angle, angle], dim=-1)
    return angle2.cos().to(torch.bfloat16), angle2.sin().to(torch.bfloat16)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rot(x) = x*cos + cat(-x2, x1)*sin in bf16 (each op rounds)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ----------------------------------------------------------------- the layer

def _layer(config, x, cache_rows, L, batch_chunk=None):
    """y for one step given the cache rows [bs, L, kv_lora+rope] (already
    appended). Literal, non-absorbed. ``batch_chunk`` bounds memory: the
    per-head keys and values of the whole cache are materialised, as in the
    task, one chunk of sequences at a time."""
    bs = x.shape[0]
    H = config.n_heads
    nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    r_kv = config.kv_lora_rank
    dev = x.device

    q_lora = x @ config.Q_proj_down_weight.T                       # [bs, 1, q_lora]
    q = (q_lora @ config.Q_proj_up_weight.T).view(bs, 1, H, nope + rope)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    cos_q, sin_q = rope_cos_sin(torch.tensor([L - 1], device=dev), rope)
    q_pe = rope_rotate(q_pe.permute(0, 2, 1, 3), cos_q, sin_q)      # [bs, H, 1, rope]
    q_full = torch.cat([q_nope.permute(0, 2, 1, 3), q_pe], dim=-1)  # [bs, H, 1, nope+rope]

    cos_k, sin_k = rope_cos_sin(torch.arange(L, device=dev), rope)
    outs = []
    step = batch_chunk or bs
    for b0 in range(0, bs, step):
        rows = cache_rows[b0:b0 + step]
        nb = rows.shape[0]
        kv_nope, k_pe = torch.split(rows, [r_kv, rope], dim=-1)
        kv = (kv_nope @ config.KV_proj_up_weight.T).view(nb, L, H, nope + v)
        k_nope, val = torch.split(kv, [nope, v], dim=-1)
        k_pe = rope_rotate(k_pe, cos_k, sin_k)                       # rotated at position t
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, H, -1)], dim=-1)
        k = k.permute(0, 2, 1, 3)                                    # [nb, H, L, nope+rope]
        val = val.permute(0, 2, 1, 3)                                # [nb, H, L, v]
        scores = torch.matmul(q_full[b0:b0 + step], k.transpose(-1, -2)) / math.sqrt(nope + rope)
        attn = torch.softmax(scores, dim=-1).to(torch.bfloat16)
        o = torch.matmul(attn, val)                                  # [nb, H, 1, v]
        outs.append(o.permute(0, 2, 1, 3).reshape(nb, 1, H * v))
        del kv, k_nope, val, k, scores, attn
    o = torch.cat(outs, dim=0)
    return o @ config.wo_weight.T                                    # [bs, 1, dim]


def decode_step(config, x, kv_cache, batch_chunk=None):
    """One task step: append the new latent row, then the layer. Mutates
    ``kv_cache`` like the task; returns ``(y, kv_cache.data)``."""
    kv_new = x @ config.KV_proj_down_weight.T                          # [bs, 1, kv_lora+rope]
    if kv_cache.seq_len >= kv_cache.data.shape[1]:
        raise ValueError("KV Cache Exceeded")
    kv_cache.data[:, kv_cache.seq_len:kv_cache.seq_len + 1] = kv_new
    kv_cache.seq_len += 1
    L = kv_cache.seq_len
    y = _layer(config, x, kv_cache.data[:, :L], L, batch_chunk=batch_chunk)
    return y, kv_cache.data


def ref_kernel(data, batch_chunk=None):
    """The task's ``ref_kernel(data)`` with ``data = (config, x, kv_cache)``."""
    config, x, kv_cache = data
    return decode_step(config, x, kv_cache, batch_chunk=batch_chunk)


def decode_step_float64(config, x, kv_cache_data, seq_len):
    """The same layer evaluated in float64 from the bf16 inputs (no
    intermediate rounding except the task's bf16 RoPE tables): the drift
    yardstick. Does not mutate anything; ``kv_cache_data`` must already hold
    the appended row at ``seq_len - 1``."""
    H = config.n_heads
    nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    r_kv = config.kv_lora_rank
    d = torch.float64
    bs, L = x.shape[0], seq_len
    dev = x.device
    xq = x.to(d)
    q = (xq @ config.Q_proj_down_weight.to(d).T) @ config.Q_proj_up_weight.to(d).T
    q = q.view(bs, H, nope + rope)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    cq, sq = (t.to(d) for t in rope_cos_sin(torch.tensor([L - 1], device=dev), rope))
    q1, q2 = q_pe.chunk(2, dim=-1)
    q_pe = q_pe * cq + torch.cat((-q2, q1), dim=-1) * sq
    rows = kv_cache_data[:, :L].to(d)
    c, k_pe = torch.split(rows, [r_kv, rope], dim=-1)
    ck, sk = (t.to(d) for t in rope_cos_sin(torch.arange(L, device=dev), rope))
    k1, k2 = k_pe.chunk(2, dim=-1)
    k_pe = k_pe * ck + torch.cat((-k2, k1), dim=-1) * sk
    wkv = config.KV_proj_up_weight.to(d).view(H, nope + v, r_kv)
    w_uk, w_uv = wkv[:, :nope], wkv[:, nope:]
    q_abs = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
    scores = (torch.einsum("bhr,blr->bhl", q_abs, c) + torch.einsum("bhp,blp->bhl", q_pe, k_pe)) / math.sqrt(nope + rope)
    p = torch.softmax(scores, dim=-1)
    o_lat = torch.einsum("bhl,blr->bhr", p, c)
    o = torch.einsum("bhr,hvr->bhv", o_lat, w_uv).reshape(bs, 1, H * v)
    return o @ config.wo_weight.to(d).T
