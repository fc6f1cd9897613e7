"""Tensor-parallel decode on torch.distributed: heads sharded, one all-reduce
of y per step.

Rank r of tp holds heads [r H/tp, (r+1) H/tp): its rows of Q_proj_up_weight
and KV_proj_up_weight and its columns of wo_weight; Q_proj_down_weight and
KV_proj_down_weight are replicated, and so is the latent cache (every rank
appends the same new row). Each rank runs the single-GPU decoder on its heads
and produces a partial y = o_r wo_r^T; one all-reduce (sum) gives the full y
on every rank. The bf16 partials are summed in fp32 and the sum rounded to
bf16 once (not once per addition); with two NCCL ranks that is one bf16
all-reduce (TPDecoder.reduce).

    import torch.distributed as dist
    dist.init_process_group("nccl")          # RCCL on ROCm builds; "gloo" on the CPU
    dec = TPDecoder(full_config, rank=dist.get_rank(), tp=dist.get_world_size())
    y, cache = dec(x, kv_cache)              # same x and a cache of the same contents on every rank

Any tp that divides n_heads works; the kernels take any head count per rank.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from .decoder import MLADecoder

__all__ = ["shard_config", "TPDecoder"]


def shard_config(config, rank: int, tp: int):
    """A copy of the task's config holding rank's shard of the weights (the
    sharded ones are contiguous copies; the replicated ones are the same
    tensors). n_heads becomes n_heads // tp."""
    H = int(config.n_heads)
    if tp < 1 or H % tp:
        raise ValueError(f"tp must divide n_heads: n_heads={H}, tp={tp}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    h = H // tp
    nope, rope, v = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim), int(config.v_head_dim)
    dq, dkv = nope + rope, nope + v
    for name, want in (("Q_proj_up_weight", H * dq), ("KV_proj_up_weight", H * dkv)):
        if getattr(config, name).shape[0] != want:
            raise ValueError(f"config.{name} must have {want} rows (n_heads * head width), "
                             f"got {list(getattr(config, name).shape)}")
    if config.wo_weight.shape[1] != H * v:
        raise ValueError(f"config.wo_weight must have {H * v} columns (n_heads * v), got {list(config.wo_weight.shape)}")
    s = copy.copy(config)
    s.n_heads = h
    # copies of their own (a row slice is contiguous already, so .contiguous() would keep the full weight
    # alive and share it), detached from autograd (nn.Parameter weights)
    s.Q_proj_up_weight = config.Q_proj_up_weight.detach()[rank * h * dq:(rank + 1) * h * dq].clone()
    s.KV_proj_up_weight = config.KV_proj_up_weight.detach()[rank * h * dkv:(rank + 1) * h * dkv].clone()
    s.wo_weight = config.wo_weight.detach()[:, rank * h * v:(rank + 1) * h * v].clone(
        memory_format=torch.contiguous_format)
    return s


class TPDecoder:
    """One MLA decode layer sharded over `tp` ranks of `group` (default: the
    world). Holds rank's weight shard (made once from the full config);
    ``dec(x, kv_cache)`` appends the new row to kv_cache in place and returns
    (y [bs, 1, dim] bf16, the full y on every rank, kv_cache.data)."""

    def __init__(self, config, rank: int, tp: int, group=None, backend: str = "auto"):
        if dist.is_initialized() and dist.get_world_size(group) != tp:
            raise ValueError(f"tp={tp} but the process group has {dist.get_world_size(group)} ranks")
        self.rank, self.tp, self.group = rank, tp, group
        self.config = shard_config(config, rank, tp)
        self.decoder = MLADecoder(backend=backend)

    @property
    def last_backend(self):
        return self.decoder.last_backend

    def partial(self, x, kv_cache):
        """This rank's partial y (bf16 projections on its heads) and the cache."""
        return self.decoder(self.config, x, kv_cache)

    def __call__(self, x, kv_cache):
        y, data = self.partial(x, kv_cache)
        return self.reduce(y), data

    def reduce(self, y):
        """The sum over ranks of the bf16 partial y, rounded to bf16 once.
        Two ranks on NCCL: one bf16 all-reduce (each element is the rounded
        sum of two bf16 values, computed in fp32: the same as summing in fp32
        and rounding; half the bytes and no conversion launches). Otherwise
        the partials are summed in fp32 and rounded at the end."""
        if self.tp == 1:
            return y
        if self.tp == 2 and dist.get_backend(self.group) == "nccl":
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
            return y
        acc = y.float()
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=self.group)
        return acc.to(torch.bfloat16)
